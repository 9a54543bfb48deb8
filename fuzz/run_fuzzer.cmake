# Runs one fuzz target for a short budget on a fresh copy of its seed corpus
# (the copy takes in what the fuzzer finds, so the checked-in corpus is never
# touched) and fails when the target crashes, leaks, times out or runs out
# of memory. Prints libFuzzer's "Done N runs in S second(s)". The CTest tests
# fuzz_<name> run it (fuzz_tests.cmake):
#   cmake -DFUZZER=<binary> -DCORPUS=<seed dir> -DWORK=<scratch dir> -DSECONDS=30 -P run_fuzzer.cmake
# A crash leaves the input that caused it, crash-<sha1>, and the whole log in WORK.
foreach(var FUZZER CORPUS WORK SECONDS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_fuzzer.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT EXISTS "${FUZZER}")
  message(FATAL_ERROR "${FUZZER} is missing: build first (cmake --build build)")
endif()

file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/corpus")
file(GLOB seeds "${CORPUS}/*")
file(COPY ${seeds} DESTINATION "${WORK}/corpus")

set(ENV{UBSAN_OPTIONS} "print_stacktrace=1")
execute_process(
  COMMAND "${FUZZER}" "${WORK}/corpus" -max_total_time=${SECONDS} -rss_limit_mb=2048 -timeout=10
          -artifact_prefix=${WORK}/ -print_final_stats=1
  RESULT_VARIABLE rc
  OUTPUT_FILE "${WORK}/log"
  ERROR_FILE "${WORK}/log")
file(READ "${WORK}/log" log)
get_filename_component(name "${FUZZER}" NAME)
string(REGEX MATCH "Done [0-9]+ runs in [0-9]+ second\\(s\\)" done "${log}")
string(REGEX MATCH "stat::number_of_executed_units: [0-9]+" units "${log}")

if(rc EQUAL 0 AND done)
  message("${name}: ${done} (${units}), from ${CORPUS}")
  file(REMOVE_RECURSE "${WORK}/corpus")
  return()
endif()

# Show the report: from the first sanitizer or libFuzzer error line on, or
# else the end of the log.
set(start -1)
foreach(marker "==ERROR:" "runtime error:" "XD_CHECK failed" "deadly signal" "ALARM:" "out-of-memory"
               "==WARNING:")
  string(FIND "${log}" "${marker}" at)
  if(at GREATER -1 AND (start EQUAL -1 OR at LESS start))
    set(start ${at})
  endif()
endforeach()
string(LENGTH "${log}" length)
if(start EQUAL -1)
  math(EXPR start "${length} - 8000")
else()
  math(EXPR start "${start} - 2000")
endif()
if(start LESS 0)
  set(start 0)
endif()
string(SUBSTRING "${log}" ${start} -1 report)
message("${report}")
file(GLOB artifacts "${WORK}/crash-*" "${WORK}/leak-*" "${WORK}/timeout-*" "${WORK}/oom-*")
message(FATAL_ERROR "${name} failed (exit ${rc}). Input: ${artifacts}; log: ${WORK}/log. "
                    "Reproduce with: ${FUZZER} <input>")
