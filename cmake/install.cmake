# Install rules of libkvcache (included by the top-level CMakeLists.txt after every target is defined).
#
#   <prefix>/include/kvcache/*.h                  public headers, version.h included
#   <prefix>/include/kvcache/runtime/*.h          public headers of the runtime library
#   <prefix>/<libdir>/libkvcache.{a,so*}          the core and the C API (SONAME libkvcache.so.<major>)
#   <prefix>/<libdir>/libkvcache_runtime.{a,so*}  the runtime library (SONAME libkvcache_runtime.so.<major>)
#   <prefix>/include/kvcache/redis/*.h            the Redis block store's headers (KVC_BUILD_REDIS)
#   <prefix>/<libdir>/libkvcache_redis.{a,so*}    the Redis block store (KVC_BUILD_REDIS; links hiredis)
#   <prefix>/<libdir>/cmake/kvcache/              find_package(kvcache CONFIG) -> kvcache::kvcache,
#                                                 kvcache::runtime (which links kvcache::kvcache),
#                                                 kvcache::redis (KVC_BUILD_REDIS)
#   <prefix>/<libdir>/pkgconfig/kvcache.pc        pkg-config kvcache (its Libs carry a run path to <libdir>, so
#                                                 a program linked with them runs without LD_LIBRARY_PATH;
#                                                 --static for libkvcache.a, KVC_BUILD_SHARED=OFF)
#   <prefix>/<libdir>/pkgconfig/kvcache-runtime.pc  pkg-config kvcache-runtime (requires kvcache)
#   <prefix>/<libdir>/pkgconfig/kvcache-redis.pc  pkg-config kvcache-redis (requires kvcache; hiredis)
#   <prefix>/bin/kvcache                          the CLI (KVC_BUILD_TOOLS)
include(CMakePackageConfigHelpers)

set(kvc_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/kvcache)

set(kvc_installed kvcache kvcache_runtime)
set(kvc_header_exclude PATTERN "redis" EXCLUDE)  # without kvcache_redis, its headers would not link
if(KVC_BUILD_REDIS)
  list(APPEND kvc_installed kvcache_redis)
  set(kvc_header_exclude)
  # it finds libkvcache beside it, also when a program links only kvcache_redis's symbols (--as-needed)
  set_target_properties(kvcache_redis PROPERTIES INSTALL_RPATH "$ORIGIN")
endif()
install(TARGETS ${kvc_installed} EXPORT kvcacheTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/kvcache/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvcache
        FILES_MATCHING PATTERN "*.h" ${kvc_header_exclude})
install(FILES ${PROJECT_BINARY_DIR}/include/kvcache/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvcache)

install(EXPORT kvcacheTargets NAMESPACE kvcache:: DESTINATION ${kvc_cmake_dir} FILE kvcacheTargets.cmake)
if(KVC_BUILD_SHARED)
  set(KVC_STATIC_PACKAGE OFF)
else()
  set(KVC_STATIC_PACKAGE ON)
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/kvcacheConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/package/kvcacheConfig.cmake
                              INSTALL_DESTINATION ${kvc_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/package/kvcacheConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/package/kvcacheConfig.cmake
              ${PROJECT_BINARY_DIR}/package/kvcacheConfigVersion.cmake
        DESTINATION ${kvc_cmake_dir})

# The .pc files are written at install time, with the prefix the tree goes to (`cmake --install --prefix`
# included), so pkg-config prints plain paths (-I/usr/local/include, not .../lib/pkgconfig/../../include).
set(kvc_pc_libdir "${CMAKE_INSTALL_LIBDIR}")
set(kvc_pc_dest "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
if(NOT IS_ABSOLUTE "${kvc_pc_libdir}")
  set(kvc_pc_libdir "\${prefix}/${kvc_pc_libdir}")
  set(kvc_pc_dest "\${CMAKE_INSTALL_PREFIX}/${kvc_pc_dest}")
endif()
set(kvc_pc_includedir "${CMAKE_INSTALL_INCLUDEDIR}")
if(NOT IS_ABSOLUTE "${kvc_pc_includedir}")
  set(kvc_pc_includedir "\${prefix}/${kvc_pc_includedir}")
endif()
# What a static link of libkvcache.a needs beyond it (pkg-config --static): the packages it uses, the
# C++ runtime (for C programs linked with cc) and the thread library.
set(kvc_pc_libs_private "-lstdc++ -lm")
if(CMAKE_THREAD_LIBS_INIT)
  string(APPEND kvc_pc_libs_private " ${CMAKE_THREAD_LIBS_INIT}")
else()
  string(APPEND kvc_pc_libs_private " -pthread")
endif()
set(kvc_pc_files kvcache kvcache-runtime)
if(KVC_BUILD_REDIS)
  list(APPEND kvc_pc_files kvcache-redis)
endif()
foreach(pc IN LISTS kvc_pc_files)
  install(CODE "
    set(kvc_pc_prefix \"\${CMAKE_INSTALL_PREFIX}\")
    set(kvc_pc_libdir [[${kvc_pc_libdir}]])
    set(kvc_pc_includedir [[${kvc_pc_includedir}]])
    set(kvc_pc_libs_private [[${kvc_pc_libs_private}]])
    set(PROJECT_VERSION [[${PROJECT_VERSION}]])
    set(PROJECT_DESCRIPTION [[${PROJECT_DESCRIPTION}]])
    configure_file([[${CMAKE_CURRENT_LIST_DIR}/${pc}.pc.in]] [[${PROJECT_BINARY_DIR}/package/${pc}.pc]] @ONLY)
    file(INSTALL DESTINATION \"${kvc_pc_dest}\" TYPE FILE
         FILES [[${PROJECT_BINARY_DIR}/package/${pc}.pc]])")
endforeach()

if(KVC_BUILD_TOOLS)
  install(TARGETS kvcache_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  if(KVC_BUILD_SHARED)  # the installed CLI finds the installed library
    set_target_properties(kvcache_cli PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
  endif()
endif()
