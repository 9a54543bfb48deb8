#include "common/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace xd {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

Status io_failure(const char* what, const std::string& path, int err) {
  std::string msg = std::string(what) + " " + path + ": " + errno_text(err);
  if (err == ENOENT) return Status::not_found(msg);
  return Status::io_error(msg);
}

// write(2) may write less than asked or be interrupted; loop until done.
Status write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_failure("cannot write", path, errno);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return Status::ok();
}

// Distinguishes temp files of concurrent writers inside one process.
std::atomic<uint64_t> g_temp_seq{0};

}  // namespace

std::string parent_dir(const std::string& path) {
  size_t end = path.size();
  while (end > 1 && path[end - 1] == '/') --end;  // "a/b/" names "a/b"
  size_t slash = path.rfind('/', end - 1);
  if (end == 0 || slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_failure("cannot open directory", dir, errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some filesystems cannot fsync directories; the data is as durable as it gets.
  if (rc != 0 && err != EINVAL && err != EROFS) return io_failure("cannot fsync directory", dir, err);
  return Status::ok();
}

Status write_file_atomic(const std::string& path, const void* data, size_t size) {
  ConstBuffer piece{data, size};
  return write_file_atomic(path, std::span<const ConstBuffer>(&piece, 1));
}

Status write_file_atomic(const std::string& path, std::span<const ConstBuffer> pieces) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(g_temp_seq.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_failure("cannot create", tmp, errno);

  Status st;
  for (const ConstBuffer& b : pieces) {
    st = write_all(fd, b.data, b.size, tmp);
    if (!st.is_ok()) break;
  }
  if (st.is_ok() && ::fsync(fd) != 0) st = io_failure("cannot fsync", tmp, errno);
  // close() can report a deferred write error (e.g. NFS), so it is checked too.
  if (::close(fd) != 0 && st.is_ok()) st = io_failure("cannot close", tmp, errno);
  if (st.is_ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    st = io_failure(("cannot rename " + tmp + " to").c_str(), path, errno);
  if (!st.is_ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  return fsync_dir(parent_dir(path));
}

Expected<std::string> read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_failure("cannot open", path, errno);
  struct stat sb;
  if (::fstat(fd, &sb) != 0) {
    int err = errno;
    ::close(fd);
    return io_failure("cannot stat", path, err);
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    return Status::io_error("not a regular file: " + path);
  }
  std::string out(static_cast<size_t>(sb.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    ssize_t n = ::read(fd, out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return io_failure("cannot read", path, err);
    }
    if (n == 0) break;  // shrank under us; report what is there
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  out.resize(got);
  return out;
}

}  // namespace xd
