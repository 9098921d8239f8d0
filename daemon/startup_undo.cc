#include "daemon/startup_undo.h"

#include <cerrno>
#include <filesystem>

#include <spdlog/spdlog.h>

namespace kvtier {

StartupUndo::~StartupUndo() {
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
    std::error_code ec;
    if (it->kind == Kind::kTree) {
      std::filesystem::remove_all(it->path, ec);
    } else {
      // A directory that something else put a file into meanwhile stays.
      std::filesystem::remove(it->path, ec);
    }
    if (ec == std::errc::directory_not_empty) {
      spdlog::debug("start-up failed: leaving {}, which holds files of others", it->path);
    } else if (ec) {
      spdlog::warn("start-up failed: leaving {} ({})", it->path, ec.message());
    } else {
      spdlog::info("start-up failed: removed {}, which it had created", it->path);
    }
  }
}

Status StartupUndo::CreateDirectories(const std::string& dir, bool whole) {
  // The missing ones, outermost first.
  std::vector<std::filesystem::path> missing;
  std::filesystem::path leaf = std::filesystem::absolute(dir).lexically_normal();
  if (!leaf.has_filename()) leaf = leaf.parent_path();  // "a/b/" is "a/b"
  for (std::filesystem::path p = leaf; !p.empty(); p = p.parent_path()) {
    std::error_code ec;
    if (std::filesystem::exists(p, ec) || ec) break;
    missing.insert(missing.begin(), p);
    if (p == p.parent_path()) break;
  }
  for (const std::filesystem::path& p : missing) {
    std::error_code ec;
    if (std::filesystem::create_directory(p, ec)) {
      created_.push_back(
          {whole && p == missing.back() ? Kind::kTree : Kind::kEmptyDir, p.string()});
    } else if (ec) {
      return Status::FromErrno(ec.value(), "creating directory " + p.string());
    }
  }
  // What exists already must be a directory.
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::FromErrno(ec ? ec.value() : ENOTDIR, "creating directory " + dir);
  }
  return Status::Ok();
}

void StartupUndo::AddFile(std::string path) { created_.push_back({Kind::kFile, std::move(path)}); }

void StartupUndo::Commit() { created_.clear(); }

}  // namespace kvtier
