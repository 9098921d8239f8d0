// StartupUndo: what a kvtierd start-up created on disk (directories, segment
// files, a new disk index), removed again if the start-up fails, so that a
// refused start leaves the machine as it found it. Only what this start-up
// created is listed: an existing segment file or disk index (a warm cache)
// is never touched.
//
// The Server owns one, declared before the parts that use those files, so it
// runs after they closed them. Thread-compatible (start-up runs on one
// thread).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace kvtier {

class StartupUndo {
 public:
  StartupUndo() = default;
  StartupUndo(const StartupUndo&) = delete;
  StartupUndo& operator=(const StartupUndo&) = delete;
  // Removes what was listed, newest first, unless Commit() was called.
  ~StartupUndo();

  // create_directories(dir), listing each directory it created. Undo
  // removes those only while empty, except `dir` itself when `whole` (its
  // contents are then this start-up's too: a new disk index).
  // Errors: the errno of mkdir, naming the path.
  Status CreateDirectories(const std::string& dir, bool whole = false);
  // A file this start-up created.
  void AddFile(std::string path);
  // Start-up succeeded: keep everything.
  void Commit();

 private:
  enum class Kind { kFile, kEmptyDir, kTree };
  struct Entry {
    Kind kind;
    std::string path;
  };
  std::vector<Entry> created_;
};

}  // namespace kvtier
