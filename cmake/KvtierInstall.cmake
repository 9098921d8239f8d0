# `cmake --install BUILD [--prefix P]`: the daemon and tools, libkvtier.so with
# its public headers, a CMake package (find_package(kvtier), kvtier::client),
# a pkg-config file, the example config and a systemd unit. Included from the
# top-level CMakeLists.txt once every target exists. tools/check-install.sh
# checks the result from a consumer's side.
#
# What is installed under the prefix (GNUInstallDirs; lib may be lib64 or
# lib/<multiarch> for prefix /usr):
#   bin/kvtierd, bin/kvtierctl, bin/kvtier-bench
#   lib/libkvtier.so{,.0.1,.0.1.0}       shared only: see client/CMakeLists.txt
#   include/kvtier/*.h                    the public headers, and the common/*.h
#   include/common/*.h                    they include (same relative paths)
#   lib/cmake/kvtier/                     kvtierConfig.cmake, version, targets
#   lib/pkgconfig/kvtier.pc
#   share/kvtier/kvtier.example.yaml
#   lib/systemd/system/kvtierd.service    KVTIER_SYSTEMD_UNIT_DIR
#   lib/sysusers.d/kvtier.conf            KVTIER_SYSUSERS_DIR: user kvtier
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KVTIER_SYSTEMD_UNIT_DIR "lib/systemd/system" CACHE STRING
    "Where the systemd unit is installed, relative to the prefix (or absolute)")
set(KVTIER_SYSUSERS_DIR "lib/sysusers.d" CACHE STRING
    "Where the sysusers.d file (the kvtier user) is installed, relative to the prefix (or absolute)")

install(TARGETS kvtierd kvtierctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# The benchmark is installed too, but is no part of the Debian package.
install(TARGETS kvtier-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT bench)

install(TARGETS kvtier_shared EXPORT kvtierTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# Public headers and exactly the common/ headers they include, transitively
# (client.h, host_memory.h and shm_kv_cache.h use common types; tl/expected.hpp comes from
# Debian's libexpected-dev). tools/check-install.sh compiles each installed
# header on its own, so a new include missing here fails the test suite.
install(FILES
  client/include/kvtier/client.h
  client/include/kvtier/kvtier.h
  client/include/kvtier/host_memory.h
  client/include/kvtier/shm_kv_cache.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvtier)
install(FILES
  common/chain_hash.h
  common/default_socket.h
  common/key128.h
  common/kv_cache_layout.h
  common/layout.h
  common/memory_mapping.h
  common/secret.h
  common/status.h
  common/unique_fd.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/common)

# CMake package: find_package(kvtier) then target_link_libraries(app kvtier::client).
set(_kvtier_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/kvtier)
install(EXPORT kvtierTargets NAMESPACE kvtier:: FILE kvtierTargets.cmake
  DESTINATION ${_kvtier_cmake_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/packaging/kvtierConfig.cmake.in
  ${PROJECT_BINARY_DIR}/packaging/kvtierConfig.cmake
  INSTALL_DESTINATION ${_kvtier_cmake_dir})
# 0.x: a new minor version may change the ABI (the soname is libkvtier.so.0.1).
write_basic_package_version_file(${PROJECT_BINARY_DIR}/packaging/kvtierConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/packaging/kvtierConfig.cmake
  ${PROJECT_BINARY_DIR}/packaging/kvtierConfigVersion.cmake
  DESTINATION ${_kvtier_cmake_dir})

# pkg-config: relocatable (paths relative to the .pc file), so that
# `cmake --install --prefix` anywhere gives a working file.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  message(FATAL_ERROR "kvtier: kvtier.pc needs CMAKE_INSTALL_LIBDIR and CMAKE_INSTALL_INCLUDEDIR relative to the prefix")
endif()
file(RELATIVE_PATH KVTIER_PC_PREFIX "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
string(REGEX REPLACE "/$" "" KVTIER_PC_PREFIX "${KVTIER_PC_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/packaging/kvtier.pc.in ${PROJECT_BINARY_DIR}/packaging/kvtier.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/packaging/kvtier.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

install(FILES config/kvtier.example.yaml DESTINATION ${CMAKE_INSTALL_DATADIR}/kvtier)

# The unit names the installed kvtierd; packaging/kvtierd.service says
# /usr/bin, and the real prefix (`cmake --install --prefix`) is only known at
# install time, so the copy is written then.
install(CODE "
  file(READ \"${PROJECT_SOURCE_DIR}/packaging/kvtierd.service\" _unit)
  string(REPLACE \"=/usr/bin/kvtierd \" \"=\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}/kvtierd \" _unit \"\${_unit}\")
  file(WRITE \"${PROJECT_BINARY_DIR}/packaging/kvtierd.service\" \"\${_unit}\")
")
install(FILES ${PROJECT_BINARY_DIR}/packaging/kvtierd.service DESTINATION ${KVTIER_SYSTEMD_UNIT_DIR})
install(FILES packaging/kvtier.sysusers.conf DESTINATION ${KVTIER_SYSUSERS_DIR} RENAME kvtier.conf)
