# The fuzz targets, by name: fuzz/fuzz_<name>.cc, the binary fuzz_<name>, the
# seed corpus fuzz/corpus/<name>/ and the CTest test fuzz_<name>. Read by
# fuzz/CMakeLists.txt and fuzz/fuzz_tests.cmake.
set(XD_FUZZ_TARGETS
  wire_header
  control_protocol
  safetensors
  codec
  job_config
  hostfile
)
