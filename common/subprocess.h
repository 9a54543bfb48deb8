// Spawning child processes (launcher, tests): fork/exec with extra environment, wait
// with a deadline (then SIGKILL), and capture of stdout+stderr into a file.
#pragma once

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

inline Child spawn(const std::vector<std::string>& argv, const std::string& log_path,
                   const std::vector<std::string>& env = {}) {
  Child c;
  c.log_path = log_path;
  c.pid = ::fork();
  if (c.pid == 0) {
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
// is returned in *out_fd (close it when done), and the child leads a process
// group of its own, so that a terminal's Ctrl-C reaches only the parent, which
// then stops its children in order (signal_group()).
inline Child spawn_piped(const std::vector<std::string>& argv, const std::vector<std::string>& env, int* out_fd) {
  int fds[2];
  Child c;
  *out_fd = -1;
  if (::pipe(fds) != 0) return c;
  c.pid = ::fork();
  if (c.pid == 0) {
    ::setpgid(0, 0);
    ::close(fds[0]);
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[1]);
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

// The exit code (or -signal) if the child has ended, else -2000.
inline int try_wait(const Child& c) {
  int status = 0;
  if (::waitpid(c.pid, &status, WNOHANG) != c.pid) return -2000;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

// Exit code, or -signal, or -1000 after killing it at the deadline.
inline int wait_for(const Child& c, std::chrono::seconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  int status = 0;
  while (std::chrono::steady_clock::now() < until) {
    pid_t r = ::waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
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
