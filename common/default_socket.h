// The unix socket kvtierd listens on, and clients connect to, when neither
// is told one: one rule for both, so that a daemon and an engine started
// without a config or KVTIER_SOCKET find each other (docs/install.md).
//
// The candidates, in order:
//   1. $KVTIER_SOCKET, when set (then the only one);
//   2. /run/kvtier/kvtierd.sock: the packaged service's (its config names it);
//   3. $XDG_RUNTIME_DIR/kvtier/kvtierd.sock, when XDG_RUNTIME_DIR is set: a
//      user's own daemon (that directory is the user's alone, mode 0700);
//   4. ./var/kvtier/kvtierd.sock: a daemon started in this directory.
// Thread-safe (reads the environment and the file system only).
#pragma once

#include <string>
#include <vector>

namespace kvtier {

// The candidates above, in order.
std::vector<std::string> DefaultSocketCandidates();

// A daemon's socket when its config names none: $KVTIER_SOCKET, else the
// user's runtime directory's, else ./var/kvtier's. It never takes
// /run/kvtier unasked: the package's config names it.
std::string DaemonDefaultSocket();

// A client's socket when the caller names none: the first candidate where
// a socket exists, else /run/kvtier/kvtierd.sock (or $KVTIER_SOCKET).
std::string ClientDefaultSocket();

}  // namespace kvtier
