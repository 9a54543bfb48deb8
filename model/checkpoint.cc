#include "model/checkpoint.h"

#include <stdio.h>  // renameat2 / RENAME_EXCHANGE (glibc, _GNU_SOURCE)
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "model/detail/checkpoint_format.h"
#include "model/distributed_checkpoint.h"
#include "model/hf_config.h"
#include "model/safetensors.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using detail::kConfigFile;
using detail::kExpAvg;
using detail::kExpAvgSq;
using detail::strip_trailing_slashes;

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kTrainerFile = "trainer_state.json";

std::string join(const std::string& dir, const char* file) { return dir + "/" + file; }

Status fs_error(const char* what, const std::string& path, const std::error_code& ec) {
  return Status::io_error(std::string(what) + " " + path + ": " + ec.message());
}

Status write_json(const std::string& path, const json& j) {
  std::string text;
  try {
    text = j.dump(2) + "\n";
  } catch (const json::exception& e) {
    return Status::internal("encoding " + path + ": " + e.what());
  }
  return write_file_atomic(path, text.data(), text.size());
}

Expected<json> read_json(const std::string& path) {
  Expected<std::string> text = read_file(path);
  if (!text) return text.status();
  try {
    return json::parse(*text);
  } catch (const json::exception& e) {
    return Status::corruption(path + ": bad JSON: " + e.what());
  }
}

// One tensor per slot, named prefix + slot name, viewing base + slot offset.
std::vector<SafetensorsEntry> entries_for(const ParamLayout& layout, const std::string& prefix,
                                          const float* base) {
  std::vector<SafetensorsEntry> out;
  out.reserve(layout.slots().size());
  for (const TensorSlot& s : layout.slots())
    out.push_back({prefix + s.name, Dtype::kF32, s.shape, base + s.offset});
  return out;
}

// Checks that `file` holds exactly the layout's tensors under `prefixes`, with
// their shapes, before anything is allocated for them.
Status check_tensors(const SafetensorsFile& file, const ParamLayout& layout,
                     const std::vector<std::string>& prefixes) {
  size_t expected = 0;
  for (const std::string& prefix : prefixes) {
    for (const TensorSlot& s : layout.slots()) {
      const std::string name = prefix + s.name;
      const TensorInfo* t = file.find(name);
      if (!t) return Status::not_found(file.path() + ": missing tensor \"" + name + "\"");
      if (t->shape != s.shape)
        return Status::invalid_argument(file.path() + ": tensor \"" + name + "\" has shape " +
                                        shape_string(t->shape) + ", the config implies " +
                                        shape_string(s.shape));
      ++expected;
    }
  }
  if (file.names().size() != expected) {
    for (const std::string& name : file.names()) {
      bool known = false;
      for (const std::string& prefix : prefixes)
        known = known || (name.starts_with(prefix) && layout.find(name.substr(prefix.size())));
      if (!known)
        return Status::invalid_argument(file.path() + ": unexpected tensor \"" + name +
                                        "\", not in the layout config.json describes");
    }
  }
  return Status::ok();
}

Status read_into(const SafetensorsFile& file, const ParamLayout& layout,
                 const std::string& prefix, std::vector<float>* out) {
  out->assign(layout.size(), 0.0f);
  for (const TensorSlot& s : layout.slots())
    XD_RETURN_IF_ERROR(file.read_f32(prefix + s.name, s.shape, out->data() + s.offset));
  return Status::ok();
}

}  // namespace

namespace detail {
json trainer_state_to_json(const TrainerState& t) {
  json j;
  j["step"] = t.step;
  j["data_position"] = t.data_position;
  j["seed"] = t.seed;
  if (std::isfinite(t.last_loss)) j["last_loss"] = t.last_loss;
  else j["last_loss"] = nullptr;
  return j;
}

Status trainer_state_from_json(const json& j, const std::string& path, TrainerState* t) {
  auto bad = [&](const char* key, const char* want) {
    return Status::corruption(path + ": key \"" + key + "\" " + want);
  };
  if (!j.is_object()) return Status::corruption(path + ": not a JSON object");
  auto step = j.find("step");
  if (step == j.end() || !step->is_number_integer() ||
      (step->is_number_unsigned() && step->get<uint64_t>() > INT64_MAX))
    return bad("step", "must be an integer");
  t->step = step->get<int64_t>();
  const char* unsigned_keys[] = {"data_position", "seed"};
  uint64_t* unsigned_fields[] = {&t->data_position, &t->seed};
  for (int i = 0; i < 2; ++i) {
    auto it = j.find(unsigned_keys[i]);
    if (it == j.end() || !it->is_number_unsigned())
      return bad(unsigned_keys[i], "must be a non-negative integer");
    *unsigned_fields[i] = it->get<uint64_t>();
  }
  auto loss = j.find("last_loss");
  if (loss == j.end() || !(loss->is_number() || loss->is_null()))
    return bad("last_loss", "must be a number or null");
  t->last_loss = loss->is_null() ? std::numeric_limits<double>::quiet_NaN()
                                 : loss->get<double>();
  return Status::ok();
}

}  // namespace detail

namespace {

// Replaces `dir` with the fully written `tmp`, then drops the old contents.
Status swap_into_place(const std::string& tmp, const std::string& dir) {
  const std::string parent = parent_dir(dir);
  std::error_code ec;
  bool exists = fs::exists(fs::symlink_status(dir, ec));
  if (!exists) {
    if (::rename(tmp.c_str(), dir.c_str()) != 0)
      return Status::io_error("cannot rename " + tmp + " to " + dir + ": " + std::strerror(errno));
    return fsync_dir(parent);
  }
#ifdef RENAME_EXCHANGE
  // One atomic step: no instant without a complete <dir>.
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    XD_RETURN_IF_ERROR(fsync_dir(parent));
    fs::remove_all(tmp, ec);  // now the old checkpoint; leftovers are harmless
    return Status::ok();
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
    return Status::io_error("cannot exchange " + tmp + " with " + dir + ": " +
                            std::strerror(errno));
#endif
  const std::string old = dir + ".old-" + std::to_string(::getpid());
  fs::remove_all(old, ec);
  if (::rename(dir.c_str(), old.c_str()) != 0)
    return Status::io_error("cannot rename " + dir + " to " + old + ": " + std::strerror(errno));
  if (::rename(tmp.c_str(), dir.c_str()) != 0) {
    int err = errno;
    ::rename(old.c_str(), dir.c_str());  // put the old checkpoint back
    return Status::io_error("cannot rename " + tmp + " to " + dir + ": " + std::strerror(err));
  }
  XD_RETURN_IF_ERROR(fsync_dir(parent));
  fs::remove_all(old, ec);
  return Status::ok();
}

Status write_all_files(const std::string& tmp, const ParamLayout& layout, const float* params,
                       const float* adam_m, const float* adam_v, int64_t adam_step,
                       const TrainerState& trainer) {
  XD_RETURN_IF_ERROR(write_safetensors(join(tmp, kModelFile), entries_for(layout, "", params),
                                       {{"format", "pt"}}));
  XD_RETURN_IF_ERROR(write_json(join(tmp, kConfigFile), model_config_to_json(layout.config())));
  if (adam_m) {
    std::vector<SafetensorsEntry> opt = entries_for(layout, kExpAvg, adam_m);
    std::vector<SafetensorsEntry> sq = entries_for(layout, kExpAvgSq, adam_v);
    opt.insert(opt.end(), sq.begin(), sq.end());
    XD_RETURN_IF_ERROR(write_safetensors(join(tmp, kOptimizerFile), opt,
                                         {{"format", "pt"}, {"step", std::to_string(adam_step)}}));
  }
  XD_RETURN_IF_ERROR(write_json(join(tmp, kTrainerFile), detail::trainer_state_to_json(trainer)));
  return fsync_dir(tmp);
}

Expected<CheckpointData> load_impl(const std::string& dir) {
  CheckpointData out;
  const std::string config_path = join(dir, kConfigFile);
  Expected<json> config_json = read_json(config_path);
  if (!config_json) return config_json.status();
  Expected<ModelConfig> config = model_config_from_json(*config_json);
  if (!config) return config.status().with_context(config_path);
  out.config = *config;
  const ParamLayout layout(out.config);

  Expected<SafetensorsFile> model = SafetensorsFile::open(join(dir, kModelFile));
  if (!model) return model.status();
  XD_RETURN_IF_ERROR(check_tensors(*model, layout, {""}));
  XD_RETURN_IF_ERROR(read_into(*model, layout, "", &out.params));

  const std::string opt_path = join(dir, kOptimizerFile);
  std::error_code ec;
  if (fs::exists(opt_path, ec)) {
    Expected<SafetensorsFile> opt = SafetensorsFile::open(opt_path);
    if (!opt) return opt.status();
    auto step = opt->metadata().find("step");
    if (step == opt->metadata().end())
      return Status::corruption(opt_path + ": metadata lacks \"step\"");
    const std::string& s = step->second;
    auto [end, err] = std::from_chars(s.data(), s.data() + s.size(), out.adam_step);
    if (err != std::errc() || end != s.data() + s.size() || out.adam_step < 0)
      return Status::corruption(opt_path + ": metadata \"step\" is \"" + s +
                                "\", not a non-negative integer");
    XD_RETURN_IF_ERROR(check_tensors(*opt, layout, {kExpAvg, kExpAvgSq}));
    XD_RETURN_IF_ERROR(read_into(*opt, layout, kExpAvg, &out.adam_m));
    XD_RETURN_IF_ERROR(read_into(*opt, layout, kExpAvgSq, &out.adam_v));
    out.has_optimizer = true;
  } else if (ec) {
    return fs_error("cannot stat", opt_path, ec);
  }

  const std::string trainer_path = join(dir, kTrainerFile);
  Expected<json> trainer = read_json(trainer_path);
  if (!trainer) return trainer.status();
  XD_RETURN_IF_ERROR(detail::trainer_state_from_json(*trainer, trainer_path, &out.trainer));
  return out;
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

}  // namespace

Status save_checkpoint(const std::string& dir_in, const ParamLayout& layout, const float* params,
                       const float* adam_m, const float* adam_v, int64_t adam_step,
                       const TrainerState& trainer) {
  const std::string dir = strip_trailing_slashes(dir_in);
  const std::string where = "saving checkpoint " + dir;
  if (dir.empty()) return Status::invalid_argument("saving checkpoint: empty directory name");
  if (layout.first_expert() != 0 || layout.num_local_experts() != layout.config().num_experts)
    return Status::invalid_argument(where + ": the layout holds experts [" +
                                    std::to_string(layout.first_expert()) + ", " +
                                    std::to_string(layout.first_expert() +
                                                   layout.num_local_experts()) +
                                    ") only; a checkpoint needs all of them");
  if (!params) return Status::invalid_argument(where + ": null params");
  if ((adam_m == nullptr) != (adam_v == nullptr))
    return Status::invalid_argument(where + ": give both AdamW moments or neither");

  std::error_code ec;
  const std::string parent = parent_dir(dir);
  fs::create_directories(parent, ec);
  if (ec) return fs_error("cannot create", parent, ec).with_context(where);
  const std::string tmp = dir + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp, ec);  // a stale one from an earlier process with our pid
  if (!fs::create_directory(tmp, ec) || ec)
    return fs_error("cannot create", tmp, ec).with_context(where);

  Status st = write_all_files(tmp, layout, params, adam_m, adam_v, adam_step, trainer);
  if (st.is_ok()) st = swap_into_place(tmp, dir);
  if (!st.is_ok()) {
    fs::remove_all(tmp, ec);
    return st.with_context(where);
  }
  return Status::ok();
}

Expected<CheckpointData> load_checkpoint(const std::string& dir_in) {
  const std::string dir = strip_trailing_slashes(dir_in);
  Expected<CheckpointData> out =
      is_distributed_checkpoint(dir) ? load_distributed_checkpoint(dir) : load_impl(dir);
  if (!out) return out.status().with_context("loading checkpoint " + dir);
  return out;
}

std::string checkpoint_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%06lld", static_cast<long long>(step));
  return buf;
}

Expected<std::string> latest_checkpoint(const std::string& root) {
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory)
      return Status::not_found("no checkpoint directory " + root);
    return fs_error("cannot list", root, ec);
  }
  std::string best;
  int64_t best_step = -1;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return fs_error("cannot list", root, ec);
    const std::string name = it->path().filename().string();
    // Exactly "step_<digits>": this excludes the .tmp-* / .old-* siblings.
    if (!name.starts_with("step_") || name.size() == 5) continue;
    int64_t step = 0;
    const char* b = name.data() + 5;
    const char* e = name.data() + name.size();
    auto [end, err] = std::from_chars(b, e, step);
    if (err != std::errc() || end != e || step < 0) continue;
    if (!it->is_directory(ec) || ec) continue;
    // Complete means the files load_checkpoint requires are there.
    // (or a distributed run's manifest, model/distributed_checkpoint.h).
    if ((!is_file(it->path() / kModelFile) || !is_file(it->path() / kConfigFile) ||
         !is_file(it->path() / kTrainerFile)) &&
        !is_file(it->path() / kManifestFile))
      continue;
    if (step > best_step) {
      best_step = step;
      best = it->path().string();
    }
  }
  if (ec) return fs_error("cannot list", root, ec);
  if (best_step < 0) return Status::not_found("no complete step_<N> checkpoint under " + root);
  return best;
}

}  // namespace xd
