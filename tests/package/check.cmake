# ctest package.examples: installs the build into a temporary prefix and builds the examples against
# it the way a user would, then runs them (each must exit 0).
#   examples/cpp  CMake, find_package(kvcache CONFIG) with CMAKE_PREFIX_PATH=<prefix>: kvcache::kvcache
#                 (main.cpp) and kvcache::runtime (runtime.cpp)
#   examples/c    cc $(pkg-config --cflags kvcache) main.c $(pkg-config --libs kvcache), the plain line
#                 (--static too when the build is static, SHARED=OFF); run without LD_LIBRARY_PATH
#   examples/cpp/runtime.cpp  c++ $(pkg-config --cflags kvcache-runtime) ... --libs --static kvcache-runtime
# Run with cmake -P and -D: BUILD_DIR SOURCE_DIR LIBDIR GENERATOR MAKE_PROGRAM CXX CC PKG_CONFIG SHARED, and
# optionally LINK_FLAGS (e.g. the sanitizer runtime of a KVC_SANITIZE build) and CXX_FLAGS.
# Works in a fresh directory under BUILD_DIR/package-test, removed afterwards (KEEP=1 keeps it).
cmake_minimum_required(VERSION 3.25)

foreach(var BUILD_DIR SOURCE_DIR LIBDIR GENERATOR CXX CC PKG_CONFIG)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "package check: -D${var}=... is required")
  endif()
endforeach()

string(TIMESTAMP stamp "%Y%m%d%H%M%S")
string(RANDOM LENGTH 8 ALPHABET "abcdefghijklmnopqrstuvwxyz0123456789" rnd)
set(work "${BUILD_DIR}/package-test/${stamp}-${rnd}")
set(prefix "${work}/prefix")
file(REMOVE_RECURSE "${work}")
file(MAKE_DIRECTORY "${work}")

# Removes the work directory (and package-test/ when no other run is using it), unless KEEP.
function(cleanup)
  if(KEEP)
    return()
  endif()
  file(REMOVE_RECURSE "${work}")
  file(GLOB others "${BUILD_DIR}/package-test/*")
  if(NOT others)
    file(REMOVE_RECURSE "${BUILD_DIR}/package-test")
  endif()
endfunction()

# Runs a command; on failure prints its output, cleans up and stops.
function(step name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc EQUAL 0)
    cleanup()
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "package check: ${name} failed (${rc})\n$ ${command}\n${out}${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
  message(STATUS "ok: ${name}")
endfunction()

step("cmake --install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
foreach(f "include/kvcache/kv_cache.h" "include/kvcache/version.h" "include/kvcache/runtime/runtime.h"
          "${LIBDIR}/cmake/kvcache/kvcacheConfig.cmake" "${LIBDIR}/cmake/kvcache/kvcacheConfigVersion.cmake"
          "${LIBDIR}/pkgconfig/kvcache.pc" "${LIBDIR}/pkgconfig/kvcache-runtime.pc")
  if(NOT EXISTS "${prefix}/${f}")
    cleanup()
    message(FATAL_ERROR "package check: ${f} not installed")
  endif()
endforeach()

# C++: find_package + kvcache::kvcache
set(generator_args -G "${GENERATOR}")
if(MAKE_PROGRAM)
  list(APPEND generator_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
step("configure examples/cpp" ${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/cpp" -B "${work}/cpp" ${generator_args}
     "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_CXX_COMPILER=${CXX}" -DCMAKE_BUILD_TYPE=Release
     "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}")
step("build examples/cpp" ${CMAKE_COMMAND} --build "${work}/cpp")
step("run examples/cpp" "${work}/cpp/kvcache_example")
message("${step_output}")
step("run examples/cpp runtime" "${work}/cpp/kvcache_example_runtime")
message("${step_output}")
if(EXISTS "${prefix}/${LIBDIR}/pkgconfig/kvcache-redis.pc")  # a build with kvcache_redis
  step("run examples/cpp redis" "${work}/cpp/kvcache_example_redis")
  message("${step_output}")
endif()

# C: pkg-config, the plain line. The .pc's run path lets the programs find libkvcache.so.0 in the prefix
# without LD_LIBRARY_PATH; a static build needs --static (fmt, xxHash, zstd, the C++ runtime).
set(ENV{PKG_CONFIG_PATH} "${prefix}/${LIBDIR}/pkgconfig")
set(static "")
if(NOT SHARED)
  set(static --static)
endif()
step("pkg-config --cflags" "${PKG_CONFIG}" --cflags kvcache)
separate_arguments(cflags UNIX_COMMAND "${step_output}")
# The paths are the prefix's own, as a reader expects them (the .pc files are written at install time).
string(FIND "${step_output}" "-I${prefix}/include" at)
if(at EQUAL -1 OR step_output MATCHES "/\\.\\./")
  message(FATAL_ERROR "pkg-config --cflags kvcache: expected -I${prefix}/include, got: ${step_output}")
endif()
step("pkg-config --libs ${static}" "${PKG_CONFIG}" --libs ${static} kvcache)
separate_arguments(libs UNIX_COMMAND "${step_output}")
separate_arguments(c_flags UNIX_COMMAND "${CXX_FLAGS}")  # warning flags apply to C as well
separate_arguments(link_flags UNIX_COMMAND "${LINK_FLAGS}")
step("build examples/c" "${CC}" -std=c11 ${c_flags} ${cflags} "${SOURCE_DIR}/examples/c/main.c"
     -o "${work}/kvcache_example_c" ${libs} ${link_flags})
step("run examples/c" "${work}/kvcache_example_c")
message("${step_output}")

# C++ with the runtime: pkg-config kvcache-runtime (which requires kvcache)
step("pkg-config --cflags kvcache-runtime" "${PKG_CONFIG}" --cflags kvcache-runtime)
separate_arguments(cflags UNIX_COMMAND "${step_output}")
step("pkg-config --libs ${static} kvcache-runtime" "${PKG_CONFIG}" --libs ${static} kvcache-runtime)
separate_arguments(libs UNIX_COMMAND "${step_output}")
separate_arguments(cxx_flags UNIX_COMMAND "${CXX_FLAGS}")
step("build examples/cpp/runtime.cpp (pkg-config)" "${CXX}" -std=c++20 -O2 ${cxx_flags} ${cflags}
     "${SOURCE_DIR}/examples/cpp/runtime.cpp" -o "${work}/kvcache_example_runtime_pc" ${libs} ${link_flags})
step("run examples/cpp/runtime.cpp (pkg-config)" "${work}/kvcache_example_runtime_pc")
message("${step_output}")

# The Redis block store: pkg-config kvcache-redis (which requires kvcache and hiredis)
if(EXISTS "${prefix}/${LIBDIR}/pkgconfig/kvcache-redis.pc")
  step("pkg-config --cflags kvcache-redis" "${PKG_CONFIG}" --cflags kvcache-redis)
  separate_arguments(cflags UNIX_COMMAND "${step_output}")
  step("pkg-config --libs ${static} kvcache-redis" "${PKG_CONFIG}" --libs ${static} kvcache-redis)
  separate_arguments(libs UNIX_COMMAND "${step_output}")
  step("build examples/cpp/redis.cpp (pkg-config)" "${CXX}" -std=c++20 -O2 ${cxx_flags} ${cflags}
       "${SOURCE_DIR}/examples/cpp/redis.cpp" -o "${work}/kvcache_example_redis_pc" ${libs} ${link_flags})
  step("run examples/cpp/redis.cpp (pkg-config)" "${work}/kvcache_example_redis_pc")
  message("${step_output}")
endif()

cleanup()
