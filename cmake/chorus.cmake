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
  chorus_precompile_torch(${T_NAME})
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

# The test programs that use libtorch build faster: most of such a program's compile time went to
# parsing <torch/torch.h> (about 15 s of every translation unit, about 40 of them) and to -O3 on
# code that mostly calls into libtorch and chorus. They share one precompiled <torch/torch.h> and
# <gtest/gtest.h> and are compiled with -Og (the libraries they test keep the build type's -O3);
# together that takes about a third off a clean build on 2 cores. The libraries (whose sources
# include their own public header first), the examples and the benchmarks compile without it, so
# a public header that forgets a libtorch include still fails our build and timings are unchanged.
# chorus_precompile_torch(target ...) marks candidates (chorus_add_test does); chorus_apply_torch_pch(),
# called once after every target exists, applies it to the candidates that link libtorch (directly
# or through a chorus library). -DCHORUS_PRECOMPILE_TORCH=OFF turns it off.
function(chorus_precompile_torch)
  set_property(GLOBAL APPEND PROPERTY CHORUS_TORCH_PCH_CANDIDATES ${ARGN})
endfunction()

# Whether `target` links libtorch: chorus_torch or torch among its link libraries, followed
# through chorus's own (non-imported) libraries.
function(_chorus_links_torch target out)
  set(pending ${target})
  set(seen "")
  set(found FALSE)
  while(pending AND NOT found)
    list(POP_FRONT pending t)
    if(t IN_LIST seen OR NOT TARGET ${t})
      continue()
    endif()
    list(APPEND seen ${t})
    get_target_property(type ${t} TYPE)
    get_target_property(imported ${t} IMPORTED)
    if(imported)
      continue()
    endif()
    set(libs "")
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(direct ${t} LINK_LIBRARIES)
      if(direct)
        list(APPEND libs ${direct})
      endif()
    endif()
    get_target_property(iface ${t} INTERFACE_LINK_LIBRARIES)
    if(iface)
      list(APPEND libs ${iface})
    endif()
    foreach(lib IN LISTS libs)
      string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" lib "${lib}")
      if(lib STREQUAL "chorus_torch" OR lib STREQUAL "torch")
        set(found TRUE)
      elseif(TARGET ${lib})
        list(APPEND pending ${lib})
      endif()
    endforeach()
  endwhile()
  set(${out} ${found} PARENT_SCOPE)
endfunction()

function(chorus_apply_torch_pch)
  get_property(candidates GLOBAL PROPERTY CHORUS_TORCH_PCH_CANDIDATES)
  if(NOT CHORUS_PRECOMPILE_TORCH OR NOT candidates)
    return()
  endif()
  # The header is built in an object library compiled like the programs that reuse it (-fPIE, not
  # the -fPIC the libraries get; -Og; gtest's flags): GCC refuses a precompiled header built with
  # other code options. CMake adds -Winvalid-pch, so a header GCC cannot use is a warning (an error
  # under CHORUS_WERROR), not a silent second parse.
  set(test_optimization $<$<NOT:$<CONFIG:Debug>>:-Og>)
  add_library(chorus_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cc)
  target_link_libraries(chorus_torch_pch PRIVATE ${TORCH_LIBRARIES} GTest::gtest)
  set_target_properties(chorus_torch_pch PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_compile_options(chorus_torch_pch PRIVATE ${CMAKE_CXX_COMPILE_OPTIONS_PIE} ${test_optimization})
  target_precompile_headers(chorus_torch_pch PRIVATE <torch/torch.h> <gtest/gtest.h>)
  foreach(t IN LISTS candidates)
    _chorus_links_torch(${t} links)
    if(links)
      target_precompile_headers(${t} REUSE_FROM chorus_torch_pch)
      target_compile_options(${t} PRIVATE ${test_optimization})
    endif()
  endforeach()
endfunction()
