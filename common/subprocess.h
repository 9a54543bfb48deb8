// Spawning child processes (launcher, tests): fork/exec with extra environment, wait
// with a deadline (then SIGKILL), and capture of stdout+stderr into a file.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace xd::subprocess {

struct Child {
  pid_t pid = -1;
  std::string log_path;
};

// `new_group`: the child leads a process group of its own (see spawn_piped).
inline Child spawn(const std::vector<std::string>& argv, const std::string& log_path,
                   const std::vector<std::string>& env = {}, bool new_group = false) {
  Child c;
  c.log_path = log_path;
  c.pid = ::fork();
  if (c.pid > 0 && new_group) ::setpgid(c.pid, c.pid);
  if (c.pid == 0) {
    if (new_group) ::setpgid(0, 0);
    FILE* f = log_path.empty() ? nullptr : std::fopen(log_path.c_str(), "w");
    if (f) {
      ::dup2(fileno(f), 1);
      ::dup2(fileno(f), 2);
    }
    for (const std::string& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::perror("execv");
    ::_exit(127);
  }
  return c;
}

// Like spawn(), but the child's stdout and stderr go to a pipe whose read end
// is returned in *out_fd (close it when done; later children do not inherit
// it), its stdin is /dev/null (an ssh would otherwise read the terminal, and
// stop, from a background group, at the first key), and it leads a process
// group of its own, so that a terminal's Ctrl-C reaches only the parent, which
// then stops its children in order (signal_group()). pid -1: fork failed.
inline Child spawn_piped(const std::vector<std::string>& argv, const std::vector<std::string>& env, int* out_fd) {
  int fds[2];
  Child c;
  *out_fd = -1;
  if (::pipe2(fds, O_CLOEXEC) != 0) return c;
  c.pid = ::fork();
  if (c.pid == 0) {
    ::setpgid(0, 0);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, 0);
    ::dup2(fds[1], 1);  // dup2 clears close-on-exec on 1 and 2
    ::dup2(fds[1], 2);
    for (const std::string& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::perror(("exec " + argv[0]).c_str());
    ::_exit(127);
  }
  ::close(fds[1]);
  if (c.pid < 0) {
    ::close(fds[0]);
    return c;
  }
  ::setpgid(c.pid, c.pid);  // also here: no race with a signal sent right after
  *out_fd = fds[0];
  return c;
}

// Sends `sig` to the process group a spawn_piped() child leads.
inline void signal_group(const Child& c, int sig) {
  if (c.pid > 0) ::kill(-c.pid, sig);
}

// The exit code (or -signal) if the child has ended, else -2000. A child
// that was never started (pid -1) or is not ours (ECHILD) counts as exited
// with 127, so that a caller's wait loop ends.
inline int try_wait(const Child& c) {
  if (c.pid <= 0) return 127;
  int status = 0;
  const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
  if (r < 0) return 127;
  if (r != c.pid) return -2000;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

// Exit code, or -signal, or -1000 after killing it at the deadline.
inline int wait_for(const Child& c, std::chrono::seconds deadline) {
  if (c.pid <= 0) return 127;
  const auto until = std::chrono::steady_clock::now() + deadline;
  int status = 0;
  while (std::chrono::steady_clock::now() < until) {
    pid_t r = ::waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    if (r < 0) return 127;  // not ours, or already reaped
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(c.pid, SIGKILL);
  ::waitpid(c.pid, &status, 0);
  return -1000;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace xd::subprocess
