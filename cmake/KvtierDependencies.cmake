# Third-party dependencies, all from Debian packages (tools/setup-deps.sh).
find_package(PkgConfig REQUIRED)
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(ZSTD REQUIRED IMPORTED_TARGET libzstd)
pkg_check_modules(HIREDIS REQUIRED IMPORTED_TARGET hiredis)

# ZMQ (libzmq3-dev; cppzmq-dev's zmq.hpp is header-only), for KV events.
pkg_check_modules(ZMQ REQUIRED IMPORTED_TARGET libzmq)

# msgpack-cxx (libmsgpack-cxx-dev), header-only, for KV events: used without
# Boost (its CMake package would pull Boost in for nothing).
find_path(KVTIER_MSGPACK_INCLUDE_DIR msgpack.hpp REQUIRED)
add_library(kvtier_msgpack INTERFACE)
target_include_directories(kvtier_msgpack SYSTEM INTERFACE ${KVTIER_MSGPACK_INCLUDE_DIR})
target_compile_definitions(kvtier_msgpack INTERFACE MSGPACK_NO_BOOST MSGPACK_DEFAULT_API_VERSION=3)

find_package(Threads REQUIRED)
find_package(tl-expected REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(FlatBuffers REQUIRED)
find_package(RocksDB REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)

if(KVTIER_BUILD_TESTS)
  find_package(GTest REQUIRED)
  find_package(benchmark REQUIRED)
endif()

# yaml-cpp 0.7 in Debian names its target yaml-cpp; newer ones yaml-cpp::yaml-cpp.
if(TARGET yaml-cpp::yaml-cpp)
  set(KVTIER_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(KVTIER_YAML_TARGET yaml-cpp)
endif()
