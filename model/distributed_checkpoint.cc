#include "model/distributed_checkpoint.h"

#include <charconv>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "common/checksum.h"
#include "model/detail/checkpoint_format.h"
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

constexpr const char* kFormat = "xdmoe-sharded";
constexpr int kVersion = 1;

Status write_json_file(const std::string& path, const json& j) {
  const std::string text = j.dump(2) + "\n";
  return write_file_atomic(path, text.data(), text.size());
}

struct Manifest {
  int64_t step = 0;
  int world = 0;
  TrainerState trainer;
  std::vector<ShardRecord> shards;  // by rank
};

// An integer field of a manifest within [lo, hi]; anything else throws
// std::invalid_argument, which read_manifest turns into corruption. (A float or
// an out-of-range value must not reach a narrowing conversion.)
int64_t int_field(const json& j, const char* key, int64_t lo, int64_t hi) {
  const json& v = j.at(key);
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)))
    throw std::invalid_argument(std::string("\"") + key + "\" must be an integer");
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    throw std::invalid_argument(std::string("\"") + key + "\" is out of range");
  return x;
}

Expected<Manifest> read_manifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifestFile;
  auto text = read_file(path);
  if (!text) return text.status();
  Manifest m;
  try {
    const json j = json::parse(*text);
    if (j.at("format").get<std::string>() != kFormat)
      return Status::corruption(path + ": format is not \"" + std::string(kFormat) + "\"");
    if (int_field(j, "version", 0, 1 << 30) != kVersion)
      return Status::corruption(path + ": version " + j.at("version").dump() + " (this build reads " +
                                std::to_string(kVersion) + ")");
    m.step = int_field(j, "step", 0, INT64_MAX);
    m.world = static_cast<int>(int_field(j, "world", 1, 65536));
    XD_RETURN_IF_ERROR(detail::trainer_state_from_json(j.at("trainer"), path, &m.trainer));
    if (m.trainer.step != m.step)
      return Status::corruption(path + ": step " + std::to_string(m.step) + " but trainer.step " +
                                std::to_string(m.trainer.step));
    m.shards.resize(m.world);
    std::vector<bool> seen(m.world, false);
    for (const json& s : j.at("shards")) {
      const int rank = static_cast<int>(int_field(s, "rank", 0, m.world - 1));
      if (rank < 0 || rank >= m.world || seen[rank])
        return Status::corruption(path + ": shard rank " + std::to_string(rank) + " is out of range or repeated");
      seen[rank] = true;
      ShardRecord& r = m.shards[rank];
      r.rank = rank;
      r.file = s.at("file").get<std::string>();
      if (r.file.empty() || r.file.find('/') != std::string::npos || r.file[0] == '.')
        return Status::corruption(path + ": shard file \"" + r.file + "\" must be a plain file name");
      r.bytes = static_cast<uint64_t>(int_field(s, "bytes", 0, INT64_MAX));
      const std::string crc = s.at("crc32c").get<std::string>();
      const char* b = crc.data() + 7;
      if (crc.size() != 15 || crc.compare(0, 7, "crc32c:") != 0 ||
          std::from_chars(b, crc.data() + crc.size(), r.crc32c, 16).ptr != crc.data() + crc.size())
        return Status::corruption(path + ": shard " + std::to_string(rank) + " has checksum \"" + crc +
                                  "\", not crc32c:<8 hex digits>");
    }
    for (int r = 0; r < m.world; ++r)
      if (!seen[r]) return Status::corruption(path + ": no entry for shard " + std::to_string(r));
  } catch (const std::exception& e) {  // json's own, and int_field's
    return Status::corruption(path + ": " + e.what());
  }
  return m;
}

// The shard's bytes, after checking them against the manifest's record.
Expected<std::string> read_shard(const std::string& dir, const ShardRecord& r) {
  const std::string path = dir + "/" + r.file;
  auto bytes = read_file(path);
  if (!bytes) return bytes.status();
  if (bytes->size() != r.bytes)
    return Status::corruption(path + ": " + std::to_string(bytes->size()) + " bytes, the manifest says " +
                              std::to_string(r.bytes) + " (torn or replaced)");
  const uint32_t crc = crc32c(bytes->data(), bytes->size());
  if (crc != r.crc32c)
    return Status::corruption(path + ": checksum " + crc32c_text(crc) + ", the manifest says " +
                              crc32c_text(r.crc32c) + " (corrupt)");
  return bytes;
}

bool is_step_name(const std::string& name, int64_t* step) {
  if (!name.starts_with("step_") || name.size() == 5) return false;
  const char* e = name.data() + name.size();
  auto [end, err] = std::from_chars(name.data() + 5, e, *step);
  return err == std::errc() && end == e && *step >= 0;
}

}  // namespace

std::string shard_file_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "shard-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

Expected<ShardRecord> save_checkpoint_shard(const std::string& dir_in, int rank, int world, const ParamLayout& layout,
                                            const float* params, const float* adam_m, const float* adam_v,
                                            int64_t adam_step, int64_t step, bool include_dense) {
  const std::string dir = strip_trailing_slashes(dir_in);
  std::error_code ec;
  const bool created = fs::create_directories(dir, ec);
  if (ec) return Status::io_error("cannot create " + dir + ": " + ec.message());
  if (created) XD_RETURN_IF_ERROR(fsync_dir(parent_dir(dir)));  // the step_<N> entry itself survives a crash
  std::vector<SafetensorsEntry> entries;
  const std::pair<const char*, const float*> kinds[] = {{"", params}, {kExpAvg, adam_m}, {kExpAvgSq, adam_v}};
  for (const auto& [prefix, base] : kinds)
    for (const TensorSlot& s : layout.slots())
      if (s.is_routed_expert() || include_dense)
        entries.push_back({prefix + s.name, Dtype::kF32, s.shape, base + s.offset});
  ShardRecord r;
  r.rank = rank;
  r.file = shard_file_name(rank, world);
  const std::string path = dir + "/" + r.file;
  XD_RETURN_IF_ERROR(write_safetensors(path, entries,
                                       {{"format", "pt"}, {"step", std::to_string(step)},
                                        {"adam_step", std::to_string(adam_step)}, {"rank", std::to_string(rank)},
                                        {"world", std::to_string(world)}}));
  // The checksum of what is on disk, so the manifest vouches for the file itself.
  auto bytes = read_file(path);
  if (!bytes) return bytes.status();
  r.bytes = bytes->size();
  r.crc32c = crc32c(bytes->data(), bytes->size());
  return r;
}

Status write_checkpoint_manifest(const std::string& dir_in, const ModelConfig& config, int world,
                                 const TrainerState& trainer, const std::vector<ShardRecord>& shards) {
  const std::string dir = strip_trailing_slashes(dir_in);
  std::vector<const ShardRecord*> by_rank(world, nullptr);
  for (const ShardRecord& s : shards) {
    if (s.rank < 0 || s.rank >= world || by_rank[s.rank])
      return Status::invalid_argument("checkpoint " + dir + ": shard rank " + std::to_string(s.rank) +
                                      " is out of range or repeated");
    by_rank[s.rank] = &s;
  }
  json list = json::array();
  for (int r = 0; r < world; ++r) {
    if (!by_rank[r]) return Status::invalid_argument("checkpoint " + dir + ": shard " + std::to_string(r) + " is missing");
    list.push_back({{"rank", r}, {"file", by_rank[r]->file}, {"bytes", by_rank[r]->bytes},
                    {"crc32c", crc32c_text(by_rank[r]->crc32c)}});
  }
  XD_RETURN_IF_ERROR(write_json_file(dir + "/" + kConfigFile, model_config_to_json(config)));
  const json manifest = {{"format", kFormat}, {"version", kVersion}, {"step", trainer.step}, {"world", world},
                         {"trainer", detail::trainer_state_to_json(trainer)}, {"shards", list}};
  return write_json_file(dir + "/" + kManifestFile, manifest);
}

bool is_distributed_checkpoint(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(strip_trailing_slashes(dir) + "/" + kManifestFile, ec);
}

Expected<CheckpointData> load_distributed_checkpoint(const std::string& dir_in) {
  const std::string dir = strip_trailing_slashes(dir_in);
  auto manifest = read_manifest(dir);
  if (!manifest) return manifest.status();
  auto config_text = read_file(dir + "/" + kConfigFile);
  if (!config_text) return config_text.status();
  CheckpointData out;
  try {
    auto config = model_config_from_json(json::parse(*config_text));
    if (!config) return config.status().with_context(dir + "/" + kConfigFile);
    out.config = *config;
  } catch (const json::exception& e) {
    return Status::corruption(dir + "/" + kConfigFile + ": " + e.what());
  }
  const ParamLayout layout(out.config);
  out.params.assign(layout.size(), 0.0f);
  out.adam_m.assign(layout.size(), 0.0f);
  out.adam_v.assign(layout.size(), 0.0f);
  std::vector<float>* targets[] = {&out.params, &out.adam_m, &out.adam_v};
  // Which shard filled each (kind, slot): every one exactly once.
  std::map<std::pair<int, std::string>, int> filled;
  int64_t adam_step = -1;
  for (const ShardRecord& r : manifest->shards) {
    auto bytes = read_shard(dir, r);
    if (!bytes) return bytes.status();
    const std::string path = dir + "/" + r.file;
    auto file = SafetensorsFile::parse(std::move(*bytes), path);
    if (!file) return file.status();
    auto it = file->metadata().find("adam_step");
    int64_t a = -1;
    if (it == file->metadata().end() ||
        std::from_chars(it->second.data(), it->second.data() + it->second.size(), a).ptr !=
            it->second.data() + it->second.size() || a < 0)
      return Status::corruption(path + ": metadata \"adam_step\" is missing or not a non-negative integer");
    if (adam_step >= 0 && a != adam_step)
      return Status::corruption(path + ": adam_step " + std::to_string(a) + ", other shards say " +
                                std::to_string(adam_step));
    adam_step = a;
    for (const std::string& name : file->names()) {
      const int kind = name.starts_with(kExpAvgSq) ? 2 : name.starts_with(kExpAvg) ? 1 : 0;
      const std::string slot_name =
          name.substr(kind == 2 ? std::string_view(kExpAvgSq).size() : kind == 1 ? std::string_view(kExpAvg).size() : 0);
      const TensorSlot* slot = layout.find(slot_name);
      if (!slot)
        return Status::invalid_argument(path + ": unexpected tensor \"" + name + "\", not in the layout config.json describes");
      auto [prev, inserted] = filled.emplace(std::make_pair(kind, slot_name), r.rank);
      if (!inserted)
        return Status::corruption(path + ": tensor \"" + name + "\" is also in shard " + std::to_string(prev->second));
      XD_RETURN_IF_ERROR(file->read_f32(name, slot->shape, targets[kind]->data() + slot->offset));
    }
  }
  const char* prefixes[] = {"", kExpAvg, kExpAvgSq};
  for (int kind = 0; kind < 3; ++kind)
    for (const TensorSlot& s : layout.slots())
      if (!filled.count({kind, s.name}))
        return Status::not_found(dir + ": no shard holds tensor \"" + std::string(prefixes[kind]) + s.name + "\"");
  out.has_optimizer = true;
  out.adam_step = adam_step;
  out.trainer = manifest->trainer;
  return out;
}

Status verify_checkpoint(const std::string& dir_in) {
  const std::string dir = strip_trailing_slashes(dir_in);
  std::error_code ec;
  if (is_distributed_checkpoint(dir)) {
    auto manifest = read_manifest(dir);
    if (!manifest) return manifest.status();
    for (const ShardRecord& r : manifest->shards)
      if (auto bytes = read_shard(dir, r); !bytes) return bytes.status();
    // config.json has no checksum: it must at least describe a model.
    auto text = read_file(dir + "/" + kConfigFile);
    if (!text) return text.status();
    try {
      auto config = model_config_from_json(json::parse(*text));
      if (!config) return config.status().with_context(dir + "/" + kConfigFile);
    } catch (const json::exception& e) {
      return Status::corruption(dir + "/" + kConfigFile + ": " + e.what());
    }
    return Status::ok();
  }
  // A one-process checkpoint is swapped in whole (save_checkpoint); it has no
  // checksums, so what can be checked is that it loads.
  for (const char* f : {"model.safetensors", "config.json", "trainer_state.json"})
    if (!fs::is_regular_file(dir + "/" + f, ec))
      return Status::not_found(dir + ": no " + std::string(f) + " and no " + kManifestFile + " (torn: not every shard arrived)");
  auto loaded = load_checkpoint(dir);
  return loaded ? Status::ok() : loaded.status();
}

Expected<std::string> latest_valid_checkpoint(const std::string& root_in, std::vector<std::string>* skipped) {
  const std::string root = strip_trailing_slashes(root_in);
  std::error_code ec;
  std::map<int64_t, std::string, std::greater<>> steps;
  for (fs::directory_iterator it(root, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    int64_t step = 0;
    if (is_step_name(it->path().filename().string(), &step) && it->is_directory(ec)) steps[step] = it->path().string();
  }
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) return Status::not_found("no checkpoint directory " + root);
    return Status::io_error("cannot list " + root + ": " + ec.message());
  }
  for (const auto& [step, dir] : steps) {
    Status st = verify_checkpoint(dir);
    if (st.is_ok()) return dir;
    if (skipped) skipped->push_back(dir + ": " + st.message());
  }
  return Status::not_found("no complete checkpoint under " + root +
                           (steps.empty() ? std::string(" (no step_<N> directories)") : " (every one failed to verify)"));
}

Expected<TrainerState> checkpoint_trainer_state(const std::string& dir_in) {
  const std::string dir = strip_trailing_slashes(dir_in);
  if (is_distributed_checkpoint(dir)) {
    auto manifest = read_manifest(dir);
    if (!manifest) return manifest.status();
    return manifest->trainer;
  }
  const std::string path = dir + "/trainer_state.json";
  auto text = read_file(path);
  if (!text) return text.status();
  TrainerState t;
  try {
    XD_RETURN_IF_ERROR(detail::trainer_state_from_json(json::parse(*text), path, &t));
  } catch (const json::exception& e) {
    return Status::corruption(path + ": " + e.what());
  }
  return t;
}

Expected<std::string> resolve_checkpoint(const std::string& path_in, std::vector<std::string>* skipped) {
  const std::string path = strip_trailing_slashes(path_in);
  std::error_code ec;
  if (is_distributed_checkpoint(path) || fs::is_regular_file(path + "/model.safetensors", ec)) {
    XD_RETURN_IF_ERROR(verify_checkpoint(path));
    return path;
  }
  int64_t step = 0;
  if (is_step_name(fs::path(path).filename().string(), &step))
    return Status::not_found(path + " is not a complete checkpoint: no " + kManifestFile + " (torn: not every shard arrived)");
  return latest_valid_checkpoint(path, skipped);
}

}  // namespace xd
