// The typed control protocol (cluster/protocol.h) and the effective job
// configuration it carries (cluster/job_config.h): every message round-trips,
// and a missing, mistyped or unknown field is an error that names it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "cluster/job_config.h"
#include "cluster/protocol.h"
#include "model/hf_config.h"

namespace xd {
namespace {

using nlohmann::json;

JobConfig example_job() {
  auto job = load_job_config(std::string(XD_SOURCE_DIR) + "/examples/4dc.yaml");
  EXPECT_TRUE(job) << job.status().to_string();
  return *job;
}

TEST(JobConfigJson, EveryFieldOfAParsedJobRoundTrips) {
  JobConfig job = example_job();
  // Values no example sets, so that every field differs from its default.
  job.train.checkpoint_dir = "runs/x";
  job.train.data.validation_fraction = 0.125;
  job.train.optimizer.grad_clip = 0.5;
  job.cluster.hosts = {{"10.0.0.1", 0, 2}, {"10.0.1.1", 1, 2}, {"10.0.2.1", 2, 2}, {"10.0.3.1", 3, 2}};
  job.cluster.expert_parallel.memory_cap_bytes = std::numeric_limits<double>::infinity();
  job.cluster.levels[0].link.codecs = {"bf16", "int8_row+zstd:1", "sr:ef:topk:0.01+zstd:1", "bf16", "bf16"};
  job.cluster.expert_parallel.base_sync_every = 7;
  job.cluster.expert_parallel.base_codec = "sign";
  job.cluster.expert_parallel.fused_encode = false;
  job.train.model.expert_init_spread = 0.25;
  job.cluster.expert_parallel.pipeline_degree = 3;
  job.cluster.expert_parallel.backward_pipeline_degree = 1;
  job.cluster.expert_parallel.replica_weight_gradients = ReplicaWeightGradients::kLate;
  job.train.farskip = {true, false, false, true};
  job.train.model.connectivity.assign(job.train.model.num_layers, Connectivity::kFarSkipMoe);
  job.train.trace_steps = {2, 5};
  job.train.trace_dir = "runs/t";
  ASSERT_TRUE(job.validate().is_ok()) << job.validate().to_string();
  const json j = job_config_to_json(job);
  auto back = job_config_from_json(json::parse(j.dump()));  // through text, as on the wire
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(job_config_to_json(*back), j);
  EXPECT_TRUE(std::isinf(back->cluster.expert_parallel.memory_cap_bytes));
  EXPECT_EQ(back->cluster.hosts.size(), 4u);
  EXPECT_EQ(back->cluster.levels[0].link.codecs.combine, "int8_row+zstd:1");
  EXPECT_EQ(back->cluster.levels[0].link.codecs.expert_gather, "sr:ef:topk:0.01+zstd:1");
  EXPECT_EQ(back->cluster.levels[0].link.codecs.dense_grad, "bf16");
  EXPECT_EQ(back->cluster.expert_parallel.base_sync_every, 7);
  EXPECT_EQ(back->cluster.expert_parallel.base_codec, "sign");
  EXPECT_FALSE(back->cluster.expert_parallel.fused_encode);
  EXPECT_EQ(back->cluster.expert_parallel.pipeline_degree, 3);
  EXPECT_EQ(back->cluster.expert_parallel.backward_pipeline_degree, 1);
  EXPECT_EQ(back->cluster.expert_parallel.tokens_once_per_worker, TokensOncePerWorker::kAuto);
  // Grouped token rows need lossless token codecs: on the default links.
  JobConfig once = default_job_config();
  once.cluster.expert_parallel.tokens_once_per_worker = TokensOncePerWorker::kOn;
  ASSERT_TRUE(once.validate().is_ok()) << once.validate().to_string();
  auto once_back = job_config_from_json(json::parse(job_config_to_json(once).dump()));
  ASSERT_TRUE(once_back) << once_back.status().to_string();
  EXPECT_EQ(once_back->cluster.expert_parallel.tokens_once_per_worker, TokensOncePerWorker::kOn);
  EXPECT_EQ(back->cluster.expert_parallel.replica_weight_gradients, ReplicaWeightGradients::kLate);
  EXPECT_TRUE(back->train.farskip.enabled);
  EXPECT_FALSE(back->train.farskip.overlapped);
  EXPECT_TRUE(back->train.farskip.moe_only);
  EXPECT_EQ(back->train.trace_steps, (std::vector<int64_t>{2, 5}));
  // The JSON path checks what the YAML path checks: FarSkip flags that
  // contradict the connectivity are refused.
  json contradiction = j;
  contradiction["farskip"]["moe_only"] = false;
  EXPECT_NE(job_config_from_json(contradiction).status().message().find("farskip.enabled"), std::string::npos)
      << job_config_from_json(contradiction).status().message();
  EXPECT_EQ(back->train.model.expert_init_spread, 0.25);
  EXPECT_EQ(back->train.optimizer.grad_clip, 0.5);
  EXPECT_EQ(back->train.model.connectivity, job.train.model.connectivity);
}

TEST(JobConfigJson, UnknownMissingAndMistypedKeysAreNamed) {
  const json good = job_config_to_json(default_job_config());
  json unknown = good;
  unknown["train"]["stepz"] = 3;
  EXPECT_NE(job_config_from_json(unknown).status().message().find("job.train.stepz: unknown key"), std::string::npos)
      << job_config_from_json(unknown).status().message();
  json missing = good;
  missing["cluster"]["levels"][1]["link"].erase("latency_s");
  EXPECT_NE(job_config_from_json(missing).status().message().find("job.cluster.levels[1].link.latency_s: missing"),
            std::string::npos)
      << job_config_from_json(missing).status().message();
  json mistyped = good;
  mistyped["train"]["batch_size"] = "sixteen";
  EXPECT_NE(job_config_from_json(mistyped).status().message().find("job.train.batch_size: has the wrong type"),
            std::string::npos);
  json invalid = good;
  invalid["cluster"]["expert_parallel"]["domain_sizes"] = {3, 1};
  EXPECT_NE(job_config_from_json(invalid).status().message().find("does not divide"), std::string::npos)
      << job_config_from_json(invalid).status().message();
}

TEST(JobConfig, TheOneProcessEquivalentTrainsTheGlobalBatch) {
  const JobConfig job = example_job();
  const TrainConfig t = one_process_equivalent(job);
  EXPECT_EQ(t.batch_size, job.train.batch_size * job.cluster.world_size());
  EXPECT_EQ(t.steps, job.train.steps);
  EXPECT_EQ(t.seed, job.train.seed);
  EXPECT_EQ(model_config_to_json(t.model), model_config_to_json(job.train.model));
}

TEST(JobConfig, CommandLineOverridesOfTheExpertParallelModeAreCheckedAndEpMeansAllOnes) {
  JobConfig job = example_job();  // 4 x 2, mode auto
  ASSERT_TRUE(override_expert_parallel(&job, "hybrid", {2, 2}).is_ok());
  EXPECT_EQ(job.cluster.expert_parallel.mode, EpMode::kHybrid);
  EXPECT_EQ(job.cluster.expert_parallel.domain_sizes, (std::vector<int>{2, 2}));
  // ep after a hybrid config: the domain sizes become all 1s, not an error.
  ASSERT_TRUE(override_expert_parallel(&job, "ep", {}).is_ok());
  EXPECT_EQ(job.cluster.expert_parallel.domain_sizes, (std::vector<int>{1, 1}));
  EXPECT_NE(override_expert_parallel(&job, "turbo", {}).message().find("--mode"), std::string::npos);
  EXPECT_NE(override_expert_parallel(&job, "hybrid", {3, 1}).message().find("does not divide"), std::string::npos);
  EXPECT_NE(override_expert_parallel(&job, "", {1}).message().find("one entry per level"), std::string::npos);
}

TEST(JobConfig, SettingsThatCannotChangeTheJobAreNamedAndTheOthersAreNot) {
  JobConfig job = example_job();  // 4 x 2, mode auto, raw links
  EXPECT_TRUE(settings_without_effect(job).empty());
  ScheduleOverrides sr;
  sr.sr_codecs = true;
  ASSERT_TRUE(override_schedule(&job, sr).is_ok());
  EXPECT_TRUE(settings_without_effect(job).empty()) << "auto may gather experts";
  job.cluster.expert_parallel.replica_weight_gradients = ReplicaWeightGradients::kLate;
  EXPECT_TRUE(settings_without_effect(job).empty()) << "overlapped by default";
  ASSERT_TRUE(override_expert_parallel(&job, "ep", {}).is_ok());
  const std::vector<std::string> ep = settings_without_effect(job);
  auto names = [](const std::vector<std::string>& notes, const std::string& key) {
    return std::any_of(notes.begin(), notes.end(), [&](const std::string& n) { return n.rfind(key + ":", 0) == 0; });
  };
  EXPECT_TRUE(names(ep, "cluster.levels[0].link.codecs.expert_gather"));
  EXPECT_TRUE(names(ep, "cluster.levels[0].link.codecs.expert_grad"));
  EXPECT_TRUE(names(ep, "cluster.expert_parallel.replica_weight_gradients"));
  EXPECT_FALSE(names(ep, "cluster.expert_parallel.base_sync_every")) << "the all-gather is sr:";

  JobConfig raw = example_job();
  raw.cluster.expert_parallel.base_codec = "sign";
  EXPECT_TRUE(names(settings_without_effect(raw), "cluster.expert_parallel.base_codec"));
  // The base's sums cross the innermost level in bf16 whatever base_codec says.
  raw.cluster.levels.back().link.codecs.expert_gather = "sr:ef:bf16";
  EXPECT_TRUE(names(settings_without_effect(raw), "cluster.expert_parallel.base_codec"));
  raw.cluster.levels.front().link.codecs.expert_gather = "sr:ef:bf16";
  EXPECT_TRUE(settings_without_effect(raw).empty());
  raw.cluster.levels.back().link.codecs.expert_gather = "raw";
  raw.cluster.levels.front().link.codecs.expert_gather = "raw";
  raw.cluster.expert_parallel.base_codec = "bf16";
  const int64_t steps = raw.train.steps;
  raw.cluster.levels[0].link.codecs.expert_gather =
      "sr:ef:bf16@" + std::to_string(steps - 1) + ":topk_sign:1@" + std::to_string(steps) + ":raw";
  const std::vector<std::string> late = settings_without_effect(raw);
  ASSERT_EQ(late.size(), 1u);
  EXPECT_NE(late[0].find("the switch at step " + std::to_string(steps) + " never applies"), std::string::npos)
      << late[0];
}

TEST(JobConfig, DeltaWeightsSetOnlyTheOutermostLinksAllGatherAndRefuseToShareItWithSrCodecs) {
  JobConfig job = example_job();
  const JobConfig before = job;
  ScheduleOverrides o;
  o.delta_weights = true;
  ASSERT_TRUE(override_schedule(&job, o).is_ok());
  EXPECT_EQ(job.cluster.levels.front().link.codecs.expert_gather, "delta:zstd:1");
  EXPECT_EQ(job.cluster.levels.front().link.codecs.expert_grad, before.cluster.levels.front().link.codecs.expert_grad);
  for (size_t l = 1; l < job.cluster.levels.size(); ++l)
    EXPECT_EQ(link_codecs_to_json(job.cluster.levels[l].link.codecs),
              link_codecs_to_json(before.cluster.levels[l].link.codecs));
  EXPECT_TRUE(job.validate().is_ok());
  o.sr_codecs = true;
  JobConfig both = before;
  const Status st = override_schedule(&both, o);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("pick one"), std::string::npos) << st.message();
}

TEST(JobConfig, SrCodecsCompressTheOutermostLinksExpertAndDenseTrafficAndLeaveTheRestAlone) {
  JobConfig job = example_job();
  job.cluster.levels.front().link.codecs.dispatch = "bf16";
  const JobConfig before = job;
  ScheduleOverrides o;
  o.sr_codecs = true;
  ASSERT_TRUE(override_schedule(&job, o).is_ok());
  const LinkCodecs& outer = job.cluster.levels.front().link.codecs;
  EXPECT_EQ(outer.expert_gather, "sr:ef:int4_row:128+zstd:1");
  EXPECT_EQ(outer.expert_grad, "ef:int4_row:128+zstd:1");
  EXPECT_EQ(outer.dense_grad, "bf16");
  EXPECT_EQ(job.cluster.expert_parallel.base_sync_every, 10);
  // Token rows keep the config's codecs; the inner link classes stay as they were.
  EXPECT_EQ(outer.dispatch, "bf16");
  EXPECT_EQ(outer.combine, before.cluster.levels.front().link.codecs.combine);
  for (size_t l = 1; l < job.cluster.levels.size(); ++l)
    EXPECT_EQ(link_codecs_to_json(job.cluster.levels[l].link.codecs),
              link_codecs_to_json(before.cluster.levels[l].link.codecs));
  EXPECT_TRUE(job.validate().is_ok());
  // Without the flag nothing changes.
  JobConfig untouched = before;
  ASSERT_TRUE(override_schedule(&untouched, ScheduleOverrides{}).is_ok());
  EXPECT_EQ(job_config_to_json(untouched), job_config_to_json(before));
}

Assignment example_assignment() {
  Assignment a;
  a.job_id = 0x7abc1234;
  a.job_name = "demo";
  a.rank = 2;
  a.job = default_job_config();
  for (int r = 0; r < 4; ++r) a.peers.push_back({r, "tcp://127.0.0.1:" + std::to_string(5000 + r), r / 2 == 1 ? 1 : 0});
  a.domain_sizes = {2, 1};
  a.flat_ep = true;
  a.predicted_step_s = 0.25;
  a.hold = true;
  return a;
}

TEST(ControlProtocol, EveryMessageRoundTrips) {
  RegisterRequest reg{kProtocolVersion, 3, "host-a", 4242, "tcp://10.0.0.1:5555"}, reg2;
  ASSERT_TRUE(from_json(to_json(reg), &reg2).is_ok());
  EXPECT_EQ(to_json(reg2), to_json(reg));

  const Assignment a = example_assignment();
  Assignment a2;
  ASSERT_TRUE(from_json(json::parse(to_json(a).dump()), &a2).is_ok()) << from_json(to_json(a), &a2).to_string();
  EXPECT_EQ(to_json(a2), to_json(a));
  EXPECT_EQ(a2.job_id, 0x7abc1234u);

  StepMetrics m, m2;
  m.step = 7;
  m.loss = 2.5;
  m.bytes = {{"dc/moe_dispatch", 1e6}};
  m.gather_wait_s = {0.1, 0.2};
  m.phase_floor_s = 0.41;
  m.fwd_compute_s = 0.12;
  m.bwd_compute_s = 0.25;
  m.cpu_s = 0.73;
  m.cpus = {0, 1};
  m.machine = "boot-id";
  ASSERT_TRUE(from_json(to_json(m), &m2).is_ok());
  EXPECT_EQ(to_json(m2), to_json(m));
  EXPECT_EQ(m2.phase_floor_s, 0.41);
  EXPECT_EQ(m2.fwd_compute_s, 0.12);
  EXPECT_EQ(m2.bwd_compute_s, 0.25);
  EXPECT_EQ(m2.cpu_s, 0.73);
  EXPECT_EQ(m2.cpus, (std::vector<int>{0, 1}));
  EXPECT_EQ(m2.machine, "boot-id");
  json negative = to_json(m);
  negative["cpu_s"] = -1.0;
  EXPECT_EQ(from_json(negative, &m2).code(), Status::Code::kInvalidArgument);
  json bad_cpu = to_json(m);
  bad_cpu["cpus"] = json::array({0, -3});
  EXPECT_EQ(from_json(bad_cpu, &m2).code(), Status::Code::kInvalidArgument);
  m.waits_s = {{step_waits::kForwardExpertAllGather, 0.012}, {step_waits::kBackwardGradientNorm, 0.008}};
  ASSERT_TRUE(from_json(json::parse(to_json(m).dump()), &m2).is_ok());
  EXPECT_EQ(m2.waits_s, m.waits_s);
  for (const double bad : {-0.001, std::numeric_limits<double>::infinity()}) {
    json bad_wait = to_json(m);
    bad_wait["waits_s"][step_waits::kBackwardGradientNorm] = bad;
    EXPECT_NE(from_json(bad_wait, &m2).message().find("metrics.waits_s"), std::string::npos) << bad;
  }
  // Names go into Prometheus labels and 80-column screens as they are.
  for (const std::string& bad : std::vector<std::string>{"", "forward", "/token_exchange", "forward/", "forward/a\"b",
                                                         "Forward/x", "forward/" + std::string(33, 'x')}) {
    json bad_name = to_json(m);
    bad_name["waits_s"][bad] = 0.1;
    EXPECT_EQ(from_json(bad_name, &m2).code(), Status::Code::kInvalidArgument) << bad;
  }
  m.codec_encode_seconds = {{"dc/dispatch", 0.0015}, {"dc/dense_grad", 0.0004}};
  m.codec_decode_seconds = {{"dc/dispatch", 0.0005}, {"dc/dense_grad", 0.0006}};
  ASSERT_TRUE(from_json(json::parse(to_json(m).dump()), &m2).is_ok());
  EXPECT_EQ(m2.codec_encode_seconds, m.codec_encode_seconds);
  EXPECT_EQ(m2.codec_decode_seconds, m.codec_decode_seconds);
  for (const std::string part : {"codec_encode_seconds", "codec_decode_seconds"}) {
    for (const double bad : {-0.001, std::numeric_limits<double>::infinity()}) {
      json bad_codec = to_json(m);
      bad_codec[part]["dc/dispatch"] = bad;
      EXPECT_NE(from_json(bad_codec, &m2).message().find("metrics." + part + ".dc/dispatch"), std::string::npos)
          << part << " " << bad;
    }
    for (const std::string& bad : std::vector<std::string>{"", "dispatch", std::string(257, '/')}) {
      json bad_key = to_json(m);
      bad_key[part][bad] = 0.1;
      EXPECT_EQ(from_json(bad_key, &m2).code(), Status::Code::kInvalidArgument) << part << " " << bad;
    }
    json older = to_json(m);  // a protocol 14 worker's report: one total per key
    older.erase(part);
    older["codec_seconds"] = {{"dc/dispatch", 0.002}};
    EXPECT_NE(from_json(older, &m2).message().find(part), std::string::npos) << part;
  }
  json many = to_json(m);
  for (int i = 0; i < 65; ++i) many["waits_s"]["backward/w" + std::string(1, char('a' + i % 26)) +
                                               std::string(i / 26 + 1, 'x')] = 0.1;
  EXPECT_NE(from_json(many, &m2).message().find("more than 64"), std::string::npos) << from_json(many, &m2).message();

  ErrorReport e{"boom"}, e2;
  ASSERT_TRUE(from_json(to_json(e), &e2).is_ok());
  EXPECT_EQ(e2.error, "boom");
  StopOrder s{"done"}, s2;
  ASSERT_TRUE(from_json(to_json(s), &s2).is_ok());
  EXPECT_EQ(s2.reason, "done");
  ThrottleRequest t{"dc", 1e6, 0.005}, t2;
  ASSERT_TRUE(from_json(to_json(t), &t2).is_ok());
  EXPECT_EQ(to_json(t2), to_json(t));
  ThrottleOrder o{1, 2e6, 0.001}, o2;
  ASSERT_TRUE(from_json(to_json(o), &o2).is_ok());
  EXPECT_EQ(to_json(o2), to_json(o));
  EXPECT_EQ(*op_of(to_json(Heartbeat{})), op::kHeartbeat);
  EXPECT_EQ(*op_of(to_json(Done{})), op::kDone);
  EXPECT_EQ(*op_of(to_json(StatusRequest{})), op::kStatus);
  EXPECT_EQ(*op_of(to_json(MetricsRequest{})), op::kMetrics);
}

TEST(ControlProtocol, ARegistrationOfAnotherVersionIsRefusedNamingBothVersions) {
  // A version-1 worker sent no version field at all.
  json old = to_json(RegisterRequest{kProtocolVersion, -1, "old", 1, "tcp://127.0.0.1:1"});
  old.erase("protocol_version");
  RegisterRequest r;
  Status st = from_json(old, &r);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.message(), protocol_mismatch_message(1));
  EXPECT_NE(st.message().find("version 1"), std::string::npos);
  EXPECT_NE(st.message().find("version " + std::to_string(kProtocolVersion)), std::string::npos);
  json future = to_json(RegisterRequest{kProtocolVersion + 1, -1, "new", 1, "tcp://127.0.0.1:1"});
  future["a_field_from_the_future"] = 1;
  st = from_json(future, &r);
  EXPECT_NE(st.message().find("version " + std::to_string(kProtocolVersion + 1)), std::string::npos) << st.message();
}

TEST(ControlProtocol, MalformedMessagesAreErrorsNamingTheField) {
  RegisterRequest r;
  EXPECT_FALSE(from_json(json::array(), &r).is_ok());
  json reg = to_json(RegisterRequest{kProtocolVersion, 0, "h", 1, "ipc:///tmp/x"});
  EXPECT_NE(from_json(reg, &r).message().find("tcp://"), std::string::npos);
  reg["data_endpoint"] = 5;
  EXPECT_NE(from_json(reg, &r).message().find("register.data_endpoint: has the wrong type"), std::string::npos)
      << from_json(reg, &r).message();

  json a = to_json(example_assignment());
  Assignment out;
  json extra = a;
  extra["surprise"] = true;
  EXPECT_NE(from_json(extra, &out).message().find("assign.surprise: unknown key"), std::string::npos);
  json few = a;
  few["peers"].erase(few["peers"].begin());
  EXPECT_NE(from_json(few, &out).message().find("3 peers for 4 workers"), std::string::npos)
      << from_json(few, &out).message();
  json bad_class = a;
  bad_class["peers"][3]["link_class"] = 9;
  EXPECT_NE(from_json(bad_class, &out).message().find("link_class"), std::string::npos);
  json bad_job = a;
  bad_job["job"]["train"].erase("steps");
  EXPECT_NE(from_json(bad_job, &out).message().find("job.train.steps: missing"), std::string::npos)
      << from_json(bad_job, &out).message();

  StepMetrics m;
  EXPECT_NE(from_json(to_json(ErrorReport{"x"}), &m).message().find("expected a 'metrics' message"), std::string::npos);
  ThrottleOrder o;
  EXPECT_FALSE(from_json(to_json(ThrottleOrder{-1, 1, 0}), &o).is_ok());
  EXPECT_FALSE(op_of(json{{"no_op", 1}}));
}

// A plan update names the pipeline degree of each direction and when the
// replicas' weight gradients come; a backward degree that does not divide
// the forward one would split a chunk, and is refused.
TEST(ControlProtocol, APlanUpdateCarriesBothPipelineDegreesAndRefusesABackwardOneThatDoesNotDivide) {
  PlanUpdate p{12, {2, 1}, 4, 2, 0.45, "link dc re-fitted", true}, back;
  ASSERT_TRUE(from_json(json::parse(to_json(p).dump()), &back).is_ok());
  EXPECT_EQ(back.pipeline_degree, 4);
  EXPECT_EQ(back.backward_pipeline_degree, 2);
  EXPECT_TRUE(back.replica_weights_late);
  EXPECT_EQ(back.domain_sizes, p.domain_sizes);
  json bad = to_json(p);
  bad["backward_pipeline_degree"] = 3;
  EXPECT_NE(from_json(bad, &back).message().find("backward pipeline degree must divide"), std::string::npos)
      << from_json(bad, &back).message();
  json missing = to_json(p);
  missing.erase("backward_pipeline_degree");
  EXPECT_NE(from_json(missing, &back).message().find("backward_pipeline_degree: missing"), std::string::npos)
      << from_json(missing, &back).message();
}

}  // namespace
}  // namespace xd
