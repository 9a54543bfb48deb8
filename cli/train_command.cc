#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cluster/job_config.h"
#include "common/atomic_file.h"
#include "common/yaml_reader.h"
#include "model/trainer.h"

namespace xd::cli {

// True when the file has a top-level `cluster:` key (a distributed job).
Expected<bool> has_cluster_section(const std::string& path) {
  auto text = read_file(path);
  if (!text) return text.status();
  auto doc = load_yaml_document(*text, path);
  if (!doc) return doc.status();
  return doc->IsMap() && static_cast<bool>((*doc)["cluster"]);
}

namespace {
struct TrainOptions {
  std::string config;
  std::string resume;
  int64_t steps = 0;
  std::string checkpoint_dir;
};

// A distributed job's config, trained as its one-process equivalent.
Expected<TrainConfig> one_process_config(const std::string& path) {
  auto job = load_job_config(path);
  if (!job) return job.status();
  const TrainConfig t = one_process_equivalent(*job);
  std::string layout;
  for (const LevelSpec& l : job->cluster.levels)
    layout += (layout.empty() ? "" : " x ") + std::to_string(l.size) + " " + l.name;
  std::printf("%s describes a distributed job: %d workers (%s), %d sequences each.\n",
              path.c_str(), job->cluster.world_size(), layout.c_str(), job->train.batch_size);
  std::printf("Training its one-process equivalent: the same model, data and seed on the global\n"
              "batch of %d sequences per step, so the losses match `xdmoe launch` of this config",
              t.batch_size);
  if (t.model.aux_loss_coef > 0)
    std::printf(",\nexcept that the router's aux loss is taken here over the whole batch and there per\n"
                "worker, so with aux_loss_coef %g the two drift apart slightly", t.model.aux_loss_coef);
  std::printf(".\n");
  return t;
}

int run_train(const TrainOptions& o) {
  TrainConfig config = default_train_config();
  if (!o.config.empty()) {
    auto distributed = has_cluster_section(o.config);
    auto loaded = !distributed ? Expected<TrainConfig>(distributed.status())
                  : *distributed ? one_process_config(o.config)
                                 : load_train_config(o.config);
    if (!loaded) {
      std::fprintf(stderr, "xdmoe train: %s\n", loaded.status().message().c_str());
      return 2;
    }
    config = *loaded;
  } else {
    std::printf("no --config given: using the built-in default (see examples/tiny.yaml)\n");
  }
  if (o.steps > 0) config.steps = o.steps;
  if (!o.checkpoint_dir.empty()) config.checkpoint_dir = o.checkpoint_dir;
  auto trainer = Trainer::create(config);
  if (!trainer) {
    std::fprintf(stderr, "xdmoe train: %s\n", trainer.status().message().c_str());
    return 2;
  }
  if (!o.resume.empty()) {
    Status st = (*trainer)->resume(o.resume);
    if (!st.is_ok()) {
      std::fprintf(stderr, "xdmoe train: resume: %s\n", st.message().c_str());
      return 2;
    }
    std::printf("resumed from %s at step %lld\n", o.resume.c_str(),
                (long long)(*trainer)->current_step());
  }
  Status st = (*trainer)->run([](const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  });
  if (!st.is_ok()) {
    std::fprintf(stderr, "xdmoe train: %s\n", st.message().c_str());
    return 1;
  }
  const auto& h = (*trainer)->history();
  if (!h.empty())
    std::printf("done: %lld steps, final loss %.4f (ce %.4f), unigram baseline %.4f\n",
                (long long)(*trainer)->current_step(), h.back().loss.loss, h.back().loss.ce_loss,
                (*trainer)->baseline_unigram_loss());
  return 0;
}
}  // namespace

void add_train_command(CLI::App& app, int* exit_code) {
  auto opts = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the MoE model in this one process");
  cmd->footer(
      "A config with a `cluster:` section (a distributed job, e.g. examples/2dc.yaml) trains\n"
      "its one-process equivalent: the same model, data and seed on the job's global batch\n"
      "(world size x train.batch_size sequences per step), to compare with `xdmoe launch`.");
  cmd->add_option("--config", opts->config, "YAML config (default: the built-in tiny model); a job config with a "
                                            "cluster section runs its one-process equivalent")
      ->check(CLI::ExistingFile);
  cmd->add_option("--resume", opts->resume, "Checkpoint directory to resume from")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--steps", opts->steps, "Override train.steps");
  cmd->add_option("--checkpoint-dir", opts->checkpoint_dir, "Override train.checkpoint_dir");
  cmd->callback([opts, exit_code] { *exit_code = run_train(*opts); });
}

}  // namespace xd::cli
