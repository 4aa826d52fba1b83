# tandem_library(NAME SRCS ... DEPS ... [PRIVATE_DEPS ...])
# Declares the library tandem::NAME with public headers in include/ beside it.
function(tandem_library name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(tandem_${name} ${ARG_SRCS})
  add_library(tandem::${name} ALIAS tandem_${name})
  target_include_directories(tandem_${name} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include)
  target_link_libraries(tandem_${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  target_compile_options(tandem_${name} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()

# tandem_test(NAME SRCS ... DEPS ... [LABELS ...])
# A GoogleTest binary registered with ctest; tests run from the build directory.
function(tandem_test name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main GTest::gmock)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES
    ENVIRONMENT "TANDEM_SOURCE_DIR=${PROJECT_SOURCE_DIR};TANDEM_BINARY_DIR=${PROJECT_BINARY_DIR}")
  if(ARG_LABELS)
    set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}")
  endif()
endfunction()
