# `cpack -G DEB` (tools/deb.sh): kvtier_<version>_amd64.deb for operators.
# What `cmake --install` puts under /usr (cmake/KvtierInstall.cmake: kvtierd,
# kvtierctl, libkvtier with its headers, CMake and pkg-config files, the
# systemd unit, the sysusers file, the example config), and a config in
# /etc/kvtier/ (a conffile). Not the Python package (the wheel carries it)
# nor kvtier-bench. Depends: comes from the libraries the binaries link
# (dpkg-shlibdeps), so `apt install ./kvtier_*.deb` pulls them from Debian.
# The maintainer scripts (packaging/deb/) create the kvtier user and group.
# Included from the top-level CMakeLists.txt after KvtierInstall.cmake.

# The config kvtierd.service starts with (packaging/kvtier.yaml: small, disk
# tier off, one tenant to edit), as a conffile (dpkg keeps local edits across
# upgrades). postinst makes it root:kvtier 0640 (it may hold tokens).
# Only cpack installs it (EXCLUDE_FROM_ALL): `cmake --install --prefix P`
# never writes this machine's /etc.
install(FILES packaging/kvtier.yaml DESTINATION /etc/kvtier COMPONENT deb EXCLUDE_FROM_ALL
  PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME kvtier)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "kvtier")
set(CPACK_PACKAGE_CONTACT "kvtier developers <kvtier-dev@users.noreply.github.com>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "tiered KV-cache offload daemon for LLM inference")
set(CPACK_PACKAGE_DESCRIPTION "kvtierd runs next to an inference engine (vLLM, SGLang, a CPU engine) \
and keeps reusable KV blocks, keyed by chained prefix hashes and salted per tenant, in GPU memory, \
pinned host memory and NVMe. This package holds the daemon, kvtierctl, the C/C++ client library \
libkvtier with its headers, and the systemd unit.")
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # kvtier_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_RELEASE "")
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# The maintainer scripts' useradd (or systemd-sysusers, where present).
set(CPACK_DEBIAN_PACKAGE_DEPENDS "passwd")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
  ${PROJECT_SOURCE_DIR}/packaging/deb/conffiles
  ${PROJECT_SOURCE_DIR}/packaging/deb/postinst
  ${PROJECT_SOURCE_DIR}/packaging/deb/prerm
  ${PROJECT_SOURCE_DIR}/packaging/deb/postrm)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# The daemon's files (no COMPONENT: "Unspecified") and the conffile; not
# the Python package's.
set(CPACK_INSTALL_CMAKE_PROJECTS
  "${PROJECT_BINARY_DIR};kvtier;Unspecified;/"
  "${PROJECT_BINARY_DIR};kvtier;deb;/")
set(CPACK_PACKAGE_FILE_NAME "kvtier_${PROJECT_VERSION}_amd64")
include(CPack)
