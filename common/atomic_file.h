// Crash-safe whole-file I/O. write_file_atomic leaves either the old file or the
// complete new one at `path`, never a torn mix: it writes a sibling temp file,
// fsyncs it, renames it over `path` and fsyncs the directory so the rename itself
// survives a power loss. All functions return Status naming the path on failure;
// none throws. Safe to call from several threads on different paths.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "common/status.h"

namespace xd {

// One piece of a gathered write; the pieces are written back to back.
struct ConstBuffer {
  const void* data = nullptr;
  size_t size = 0;
};

// Temp file is "<path>.tmp.<pid>.<seq>"; it is removed again on any failure.
Status write_file_atomic(const std::string& path, const void* data, size_t size);
Status write_file_atomic(const std::string& path, std::span<const ConstBuffer> pieces);

// The whole file. not_found if it does not exist, io_error otherwise.
Expected<std::string> read_file(const std::string& path);

// fsync of a directory, which makes renames and creations inside it durable.
Status fsync_dir(const std::string& dir);

// The directory part of `path` ("." when it has none), for fsync_dir.
std::string parent_dir(const std::string& path);

}  // namespace xd
