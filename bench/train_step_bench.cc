// Tokens/s of a training step (forward + backward + AdamW) on a config, by
// default the built-in one. Usage: train_step_bench [--config FILE] [--steps N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "model/trainer.h"

int main(int argc, char** argv) {
  std::string config_path;
  int steps = 30;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--config") && i + 1 < argc) config_path = argv[++i];
    else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--config FILE] [--steps N]\n", argv[0]);
      return 2;
    }
  }
  if (steps < 2) {
    std::fprintf(stderr, "--steps must be at least 2\n");
    return 2;
  }
  xd::TrainConfig cfg = xd::default_train_config();
  if (!config_path.empty()) {
    auto loaded = xd::load_train_config(config_path);
    if (!loaded) {
      std::fprintf(stderr, "%s\n", loaded.status().message().c_str());
      return 2;
    }
    cfg = *loaded;
  }
  cfg.steps = steps + 1;
  auto trainer = xd::Trainer::create(cfg);
  if (!trainer) {
    std::fprintf(stderr, "%s\n", trainer.status().message().c_str());
    return 2;
  }
  if (!(*trainer)->step()) return 1;  // warm-up: first-touch allocations
  std::vector<double> tps;
  for (int i = 0; i < steps; ++i) {
    auto s = (*trainer)->step();
    if (!s) {
      std::fprintf(stderr, "%s\n", s.status().message().c_str());
      return 1;
    }
    tps.push_back(s->tokens_per_second);
  }
  std::sort(tps.begin(), tps.end());
  const char* threads = std::getenv("OPENBLAS_NUM_THREADS");
  std::printf("config %s | %d x %d tokens/step | %d steps | OPENBLAS_NUM_THREADS=%s\n",
              config_path.empty() ? "<built-in default>" : config_path.c_str(), cfg.batch_size,
              cfg.seq_len, steps, threads ? threads : "(unset)");
  std::printf("tokens/s: median %.0f, min %.0f, max %.0f\n", tps[tps.size() / 2], tps.front(),
              tps.back());
  return 0;
}
