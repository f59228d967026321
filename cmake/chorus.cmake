# chorus_add_test(NAME name SOURCES a.cc ... LIBS lib ... LABELS unit|multiproc|parity|slow TIMEOUT s)
# Every test gets a label and a timeout: a hung test fails instead of stalling CI.
function(chorus_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS;ARGS" ${ARGN})
  if(NOT T_TIMEOUT)
    message(FATAL_ERROR "chorus_add_test(${T_NAME}): TIMEOUT is required")
  endif()
  if(NOT T_LABELS)
    message(FATAL_ERROR "chorus_add_test(${T_NAME}): LABELS is required")
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  add_test(NAME ${T_NAME} COMMAND ${T_NAME} ${T_ARGS})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}")
endfunction()

# chorus_add_script_test(NAME name COMMAND cmd... LABELS ... TIMEOUT s [SKIP_REGEX re]): a test driven
# by a program or script (also a test executable run again with another --gtest_filter). SKIP_REGEX:
# output that marks the test skipped (a parity test without its Python reference says "[  SKIPPED ]").
function(chorus_add_script_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT;SKIP_REGEX" "COMMAND;LABELS" ${ARGN})
  if(NOT T_TIMEOUT OR NOT T_LABELS)
    message(FATAL_ERROR "chorus_add_script_test(${T_NAME}): TIMEOUT and LABELS are required")
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_COMMAND})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}")
  if(T_SKIP_REGEX)
    set_tests_properties(${T_NAME} PROPERTIES SKIP_REGULAR_EXPRESSION "${T_SKIP_REGEX}")
  endif()
endfunction()

# chorus_export_library(chorus_comm comm): the library is installed and exported as chorus::comm,
# and the same name works in the build tree (add_subdirectory consumers link chorus::comm too).
function(chorus_export_library target name)
  add_library(chorus::${name} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
  set_property(GLOBAL APPEND PROPERTY CHORUS_EXPORTED_LIBRARIES ${target})
endfunction()

# chorus_add_mpi_test(NAME name NP n COMMAND prog args... TIMEOUT s): `prog` on n ranks under mpirun
# (tests/mpi/run-under-mpirun: as root, oversubscribed, on this host). Labels multiproc and mpi; a
# machine without mpirun skips it (exit 77) with a message saying what to install.
function(chorus_add_mpi_test)
  cmake_parse_arguments(T "" "NAME;NP;TIMEOUT" "COMMAND" ${ARGN})
  if(NOT T_TIMEOUT OR NOT T_NP)
    message(FATAL_ERROR "chorus_add_mpi_test(${T_NAME}): NP and TIMEOUT are required")
  endif()
  add_test(NAME ${T_NAME} COMMAND ${PROJECT_SOURCE_DIR}/tests/mpi/run-under-mpirun ${T_NP} ${T_COMMAND})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "multiproc;mpi" SKIP_RETURN_CODE 77)
endfunction()
