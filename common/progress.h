// ProgressLine: the progress of long work on stdout. On a terminal a live
// line at the bottom is redrawn in place -- a bar, a short text, the ETA --
// while the lines that must stay (line()) scroll above it. Off a terminal (a
// file, a pipe, CI) there is no live line: only line()'s plain lines. Print
// anything else only after clear(). Not thread-safe: one caller thread.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <string>

namespace xd {

class ProgressLine {
 public:
  explicit ProgressLine(FILE* out = stdout) : ProgressLine(out, ::isatty(::fileno(out)) != 0) {}
  ProgressLine(FILE* out, bool terminal) : out_(out), terminal_(terminal) {}

  // The live line: `done` of `total` units finished. Terminal only.
  void live(long long done, long long total, double elapsed_s, const std::string& text) {
    if (!terminal_) return;
    constexpr int kWidth = 20;
    const int filled = total > 0 ? static_cast<int>(kWidth * done / total) : 0;
    std::string bar(filled, '#');
    bar.resize(kWidth, '.');
    // \r: back to the start of the line; \033[K: clear what the last draw left.
    std::fprintf(out_, "\r\033[K[%s] %s%s", bar.c_str(), text.c_str(), eta(done, total, elapsed_s).c_str());
    open_ = true;
    std::fflush(out_);
  }

  // A line that stays, above the live line.
  void line(const std::string& text) {
    clear();
    std::fprintf(out_, "%s\n", text.c_str());
    std::fflush(out_);
  }

  // Removes the live line, so that other output starts on a clean line.
  void clear() {
    if (open_) std::fprintf(out_, "\r\033[K");
    open_ = false;
  }

  // " | ETA 3m05s" while work remains, else "".
  static std::string eta(long long done, long long total, double elapsed_s) {
    if (done <= 0 || done >= total) return "";
    return " | ETA " + duration(elapsed_s / done * (total - done));
  }

  // "42 s", "3m05s", "1h02m"
  static std::string duration(double s) {
    char buf[32];
    if (s < 60) std::snprintf(buf, sizeof buf, "%.0f s", s);
    else if (s < 3600) std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
    else std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s) / 3600, static_cast<int>(s) / 60 % 60);
    return buf;
  }

 private:
  FILE* out_;
  bool terminal_;
  bool open_ = false;  // a live line is drawn
};

}  // namespace xd
