# Included by the top-level CMakeLists.txt when the tests are built. Builds
# the libFuzzer targets of fuzz/ with clang as a project of their own in
# build/fuzz (part of `cmake --build build`), and adds one CTest test per
# target, fuzz_<name>, that fuzzes it for 30 s on a copy of its seed corpus
# (run_fuzzer.cmake). README.md here tells how to fuzz for longer.
find_program(XD_FUZZ_CXX NAMES clang++ clang++-14)
if(NOT XD_FUZZ_CXX)
  message(FATAL_ERROR "clang++ not found. The fuzz tests (fuzz/) are built with clang and libFuzzer: "
                      "install the Debian packages clang and libclang-rt-14-dev "
                      "(bash scripts/install-deps.sh installs them).")
endif()
execute_process(COMMAND ${XD_FUZZ_CXX} -print-resource-dir
                OUTPUT_VARIABLE xd_fuzz_resource_dir OUTPUT_STRIP_TRAILING_WHITESPACE)
file(GLOB xd_fuzz_runtime "${xd_fuzz_resource_dir}/lib/*/libclang_rt.fuzzer*.a")
if(NOT xd_fuzz_runtime)
  message(FATAL_ERROR "${XD_FUZZ_CXX} has no libFuzzer runtime (libclang_rt.fuzzer) under "
                      "${xd_fuzz_resource_dir}/lib: install the Debian package libclang-rt-14-dev "
                      "(bash scripts/install-deps.sh installs it).")
endif()

include(ExternalProject)
ExternalProject_Add(xd_fuzz
  SOURCE_DIR ${CMAKE_CURRENT_LIST_DIR}
  BINARY_DIR ${CMAKE_BINARY_DIR}/fuzz
  CMAKE_ARGS -DCMAKE_CXX_COMPILER=${XD_FUZZ_CXX}
  INSTALL_COMMAND ""
  BUILD_ALWAYS ON)

include(${CMAKE_CURRENT_LIST_DIR}/targets.cmake)
foreach(name ${XD_FUZZ_TARGETS})
  add_test(NAME fuzz_${name}
           COMMAND ${CMAKE_COMMAND} -DFUZZER=${CMAKE_BINARY_DIR}/fuzz/fuzz_${name}
                   -DCORPUS=${CMAKE_CURRENT_LIST_DIR}/corpus/${name}
                   -DWORK=${CMAKE_BINARY_DIR}/fuzz/run/${name} -DSECONDS=30
                   -P ${CMAKE_CURRENT_LIST_DIR}/run_fuzzer.cmake)
  set_tests_properties(fuzz_${name} PROPERTIES TIMEOUT 180 LABELS fuzz)
endforeach()
