// The coordinator's aggregation of per-step metrics (coordinator/job_metrics.h):
// a step is complete when every worker reported it, its bound is
// max(compute, busiest link), and raw and wire bytes are exported apart.
#include <gtest/gtest.h>

#include <string>

#include "coordinator/job_metrics.h"

namespace xd {
namespace {

StepMetrics report(int64_t step, double compute, double busy) {
  StepMetrics m;
  m.step = step;
  m.loss = 2.0;
  m.step_s = 1.0;
  m.compute_s = compute;
  m.link_busy_s = busy;
  m.codec_s = compute / 10;
  m.bytes = {{"dc/moe_dispatch", 50}, {"dc/moe_dispatch_raw", 100}, {"dc/total", 80}};
  return m;
}

TEST(JobMetrics, AStepIsCompleteWhenEveryWorkerReportedAndItsBoundIsTheLargerStream) {
  JobMetrics metrics(2);
  metrics.record(0, report(1, 0.3, 0.5));
  EXPECT_EQ(metrics.last_complete(), nullptr) << "one of two workers";
  metrics.record(1, report(1, 0.4, 0.2));
  ASSERT_NE(metrics.last_complete(), nullptr);
  const StepSummary& s = *metrics.last_complete();
  EXPECT_DOUBLE_EQ(s.compute_s, 0.4);      // the slowest worker
  EXPECT_DOUBLE_EQ(s.link_busy_s, 0.5);    // the busiest worker's busiest link
  EXPECT_DOUBLE_EQ(s.bound_s(), 0.5);
  EXPECT_DOUBLE_EQ(s.codec_s, 0.04);       // the slowest worker's codec time
  EXPECT_DOUBLE_EQ(s.bytes.at("dc/moe_dispatch_raw"), 200);  // summed over workers
}

TEST(JobMetrics, APredictionTheCoordinatorSetsReplacesTheWorkersFromItsStepOn) {
  JobMetrics metrics(2);
  auto told = [](int64_t step) {
    StepMetrics m = report(step, 0.3, 0.1);
    m.predicted_step_s = 0.25;  // what the workers were told at start
    return m;
  };
  metrics.set_predicted_step(3, 0.4);
  for (int64_t step = 1; step <= 4; ++step) {
    metrics.record(0, told(step));
    metrics.record(1, told(step));
    EXPECT_DOUBLE_EQ(metrics.last_complete()->predicted_step_s, step < 3 ? 0.25 : 0.4) << step;
  }
  metrics.set_predicted_step(5, 0.5);
  metrics.record(1, told(5));
  metrics.record(0, told(5));
  EXPECT_DOUBLE_EQ(metrics.last_complete()->predicted_step_s, 0.5);
  EXPECT_DOUBLE_EQ(metrics.mean(0).predicted_step_s, (0.25 * 2 + 0.4 * 2 + 0.5) / 5);
}

TEST(JobMetrics, TheComputeSpreadIsTheSlowestWorkersComputeMinusTheFastestsWhateverTheOrder) {
  JobMetrics metrics(3);
  metrics.record(2, report(1, 0.35, 0.1));
  metrics.record(0, report(1, 0.30, 0.1));
  metrics.record(1, report(1, 0.42, 0.1));
  ASSERT_NE(metrics.last_complete(), nullptr);
  EXPECT_NEAR(metrics.last_complete()->compute_spread_s(), 0.12, 1e-12);
  metrics.record(1, report(2, 0.20, 0.1));
  metrics.record(0, report(2, 0.20, 0.1));
  metrics.record(2, report(2, 0.20, 0.1));
  EXPECT_EQ(metrics.last_complete()->compute_spread_s(), 0.0);
  EXPECT_NEAR(metrics.mean(0).compute_spread_s(), 0.06, 1e-12);
  EXPECT_NE(metrics.prometheus("job", {"running", "running", "running"}).find("xdmoe_compute_spread_seconds"), std::string::npos);
}

TEST(JobMetrics, ThePhaseFloorIsTheHighestWorkersAndTheStepIsMeasuredAgainstIt) {
  JobMetrics metrics(2);
  StepMetrics a = report(1, 0.30, 0.25), b = report(1, 0.35, 0.20);
  a.phase_floor_s = 0.45;  // this worker's backward traffic outlasted its backward compute
  b.phase_floor_s = 0.35;
  a.step_s = b.step_s = 0.5;
  metrics.record(1, b);
  metrics.record(0, a);
  ASSERT_NE(metrics.last_complete(), nullptr);
  const StepSummary& s = *metrics.last_complete();
  EXPECT_DOUBLE_EQ(s.phase_floor_s, 0.45);
  EXPECT_DOUBLE_EQ(s.bound_s(), 0.35);
  EXPECT_NEAR(s.step_over_phase_floor(), 0.5 / 0.45, 1e-12);
  a.step = b.step = 2;
  a.phase_floor_s = b.phase_floor_s = 0.25;
  metrics.record(0, a);
  metrics.record(1, b);
  EXPECT_NEAR(metrics.mean(0).phase_floor_s, 0.35, 1e-12);
  const std::string text = metrics.prometheus("j", {"running", "running"});
  EXPECT_NE(text.find("xdmoe_phase_floor_seconds{job=\"j\"} 0.25\n"), std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_step_over_phase_floor{job=\"j\"} 2\n"), std::string::npos) << text;
}

TEST(JobMetrics, TheCpuFloorIsTheBusiestMachinesWorkersCpuTimeOverTheCoresTheyShare) {
  JobMetrics metrics(4);
  StepMetrics a = report(1, 0.30, 0.1), b = report(1, 0.30, 0.1), c = report(1, 0.30, 0.1), d = report(1, 0.30, 0.1);
  a.step_s = b.step_s = c.step_s = d.step_s = 0.5;
  // a and b share machine m1's cores 0 and 1 (registered under two host
  // names, as network namespaces of one machine are); c and d each have two
  // of machine m2's 8 cores to themselves.
  a.cpu_s = 0.40, b.cpu_s = 0.50, c.cpu_s = 0.30, d.cpu_s = 0.35;
  a.cpus = b.cpus = {0, 1};
  c.cpus = {0, 1}, d.cpus = {2, 3};
  a.machine = b.machine = "m1";
  c.machine = d.machine = "m2";
  metrics.record(0, a, "dc0-w0");
  metrics.record(2, c, "node-b");
  metrics.record(1, b, "dc0-w1");
  metrics.record(3, d, "node-b");
  ASSERT_NE(metrics.last_complete(), nullptr);
  const StepSummary& s = *metrics.last_complete();
  EXPECT_NEAR(s.cpu_floor_s, 0.45, 1e-12);  // m1: 0.9 s of CPU on 2 cores; m2: 0.65 s on 4
  EXPECT_NEAR(s.step_over_cpu_floor(), 0.5 / 0.45, 1e-12);
  // A report without a machine falls back on the host it registered from.
  a.step = b.step = c.step = d.step = 2;
  a.machine = b.machine = c.machine = d.machine = "";
  metrics.record(0, a, "dc0-w0");
  metrics.record(1, b, "dc0-w1");
  metrics.record(2, c, "node-b");
  metrics.record(3, d, "node-b");
  EXPECT_NEAR(metrics.last_complete()->cpu_floor_s, 0.25, 1e-12);  // b alone on its 2 cores
  // A worker that cannot read its CPUs reports none: no floor for that step,
  // and the mean is over the steps that have one.
  a.step = b.step = c.step = d.step = 3;
  a.cpus = b.cpus = c.cpus = d.cpus = {};
  metrics.record(0, a, "dc0-w0");
  metrics.record(1, b, "dc0-w1");
  metrics.record(2, c, "node-b");
  metrics.record(3, d, "node-b");
  EXPECT_EQ(metrics.last_complete()->cpu_floor_s, 0.0);
  EXPECT_EQ(metrics.last_complete()->step_over_cpu_floor(), 0.0);
  const std::string text = metrics.prometheus("j", {"running", "running", "running", "running"});
  EXPECT_NE(text.find("xdmoe_cpu_floor_seconds{job=\"j\"} 0\n"), std::string::npos) << text;
  EXPECT_NEAR(metrics.mean(0).cpu_floor_s, (0.45 + 0.25) / 2, 1e-12);
}

TEST(JobMetrics, PrometheusExportsWireAndRawBytesAsTwoMetricsWithTheSameLabels) {
  JobMetrics metrics(1);
  metrics.record(0, report(1, 0.3, 0.5));
  const std::string text = metrics.prometheus("j", {"running"});
  EXPECT_NE(text.find("xdmoe_step_bytes{job=\"j\",link=\"dc\",op=\"moe_dispatch\"} 50\n"), std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_step_raw_bytes{job=\"j\",link=\"dc\",op=\"moe_dispatch\"} 100\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("moe_dispatch_raw"), std::string::npos) << "the suffix is the metric's, not the label's";
  EXPECT_NE(text.find("xdmoe_bound_seconds{job=\"j\"} 0.5\n"), std::string::npos) << text;
}

// A hop of a token A2A lasts as long as its larger side: summed over the
// hops and workers, the larger sides over the rows sent is the imbalance.
TEST(JobMetrics, TheA2AImbalanceIsTheHopsLargerSidesOverTheRowsSent) {
  StepSummary s;
  s.bytes = {{"dc/moe_dispatch_raw", 100}, {"dc/moe_combine_raw", 100}, {"dc/moe_peak_raw", 250},
             {"worker/moe_dispatch_raw", 100}, {"worker/moe_combine_raw", 100}, {"worker/moe_peak_raw", 190}};
  EXPECT_DOUBLE_EQ(s.a2a_imbalance("dc"), 1.25);
  EXPECT_DOUBLE_EQ(s.a2a_imbalance("worker"), 1.0) << "never below uniform routing";
  EXPECT_EQ(s.a2a_imbalance("rack"), 0.0) << "no token crossed it";
  s.bytes["dc/moe_peak_raw"] = 0;
  EXPECT_EQ(s.a2a_imbalance("dc"), 0.0) << "not measured";
}

// Per direction: overlap = 1 - exposed / comm of the worst worker, never
// below 0; step / bound beside them.
TEST(JobMetrics, OverlapIsReportedPerDirectionBesideStepOverBound) {
  JobMetrics metrics(2);
  StepMetrics a = report(1, 0.4, 0.5), b = report(1, 0.3, 0.2);
  a.fwd_comm_s = 0.2, a.fwd_exposed_s = 0.05, a.bwd_comm_s = 0.3, a.bwd_exposed_s = 0.3;
  b.fwd_comm_s = 0.1, b.fwd_exposed_s = 0.02, b.bwd_comm_s = 0.1, b.bwd_exposed_s = 0.1;
  a.fwd_compute_s = 0.05, a.bwd_compute_s = 0.35;  // each worker's two sum to its compute
  b.fwd_compute_s = 0.18, b.bwd_compute_s = 0.12;
  metrics.record(0, a);
  metrics.record(1, b);
  const StepSummary& s = *metrics.last_complete();
  EXPECT_DOUBLE_EQ(s.fwd_overlap_percent(), 75.0);
  EXPECT_DOUBLE_EQ(s.bwd_overlap_percent(), 0.0);
  EXPECT_DOUBLE_EQ(s.step_over_bound(), 2.0);  // 1 s over max(0.4, 0.5)
  EXPECT_DOUBLE_EQ(StepSummary::overlap(0.3, 0.2), 0.0) << "more exposed than busy is no overlap, not negative";
  const std::string text = metrics.prometheus("j", {"running", "running"});
  EXPECT_NE(text.find("xdmoe_direction_overlap_percent{job=\"j\",direction=\"forward\"} 75\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("xdmoe_direction_exposed_comm_seconds{job=\"j\",direction=\"backward\"} 0.3\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_step_over_bound{job=\"j\"} 2\n"), std::string::npos) << text;
  // Each pass's compute beside its link, the highest worker's per pass
  // (b's forward, a's backward): the forward is bound by its link (0.2 s
  // against 0.18 s of compute), the backward by its compute (0.35 s
  // against 0.3 s).
  EXPECT_DOUBLE_EQ(s.fwd_compute_s, 0.18);
  EXPECT_DOUBLE_EQ(s.bwd_compute_s, 0.35);
  EXPECT_NE(text.find("xdmoe_direction_compute_seconds{job=\"j\",direction=\"forward\"} 0.18\n"),
            std::string::npos) << text;
  EXPECT_DOUBLE_EQ(metrics.to_json()["last_step"]["fwd_compute_s"].get<double>(), 0.18);
  // A second step: the run's mean is over the steps.
  StepMetrics c = report(2, 0.4, 0.5), d = report(2, 0.3, 0.2);
  c.fwd_compute_s = 0.1, c.bwd_compute_s = 0.3;
  d.fwd_compute_s = 0.06, d.bwd_compute_s = 0.24;
  metrics.record(0, c);
  metrics.record(1, d);
  EXPECT_DOUBLE_EQ(metrics.mean(0).fwd_compute_s, (0.18 + 0.1) / 2);
  EXPECT_DOUBLE_EQ(metrics.mean(0).bwd_compute_s, (0.35 + 0.3) / 2);
}

// The step's communication time beside its exposed part, and the forward's
// wait for each layer's gathered experts, the most-waiting worker's per layer.
TEST(JobMetrics, PrometheusCarriesTheStepsCommunicationAndEachLayersWaitForGatheredExperts) {
  JobMetrics metrics(2);
  StepMetrics a = report(1, 0.4, 0.5), b = report(1, 0.3, 0.2);
  a.comm_s = 0.25, b.comm_s = 0.5;
  a.gather_wait_s = {0.004, 0.0, 0.001}, b.gather_wait_s = {0.002, 0.003, 0.0};
  metrics.record(0, a);
  metrics.record(1, b);
  const std::string text = metrics.prometheus("j", {"running", "running"});
  EXPECT_NE(text.find("xdmoe_comm_seconds{job=\"j\"} 0.5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_gather_wait_seconds{job=\"j\",layer=\"0\"} 0.004\n"), std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_gather_wait_seconds{job=\"j\",layer=\"1\"} 0.003\n"), std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_gather_wait_seconds{job=\"j\",layer=\"2\"} 0.001\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("layer=\"3\""), std::string::npos) << text;
  // Without gathered experts (EP) there is no such gauge.
  JobMetrics ep(1);
  ep.record(0, report(1, 0.4, 0.5));
  EXPECT_EQ(ep.prometheus("j", {"running"}).find("xdmoe_gather_wait_seconds"), std::string::npos);
}

TEST(JobMetrics, CodecTimeAndErrorArePerLinkClassAndTrafficKindTheBusiestWorkersAndPrometheusLabelsBoth) {
  JobMetrics metrics(2);
  StepMetrics a = report(1, 0.4, 0.5), b = report(1, 0.3, 0.2);
  // Each key's total, the busiest worker's (here b's dispatch); each part,
  // its busiest worker's (here a's dispatch encoding and b's decoding).
  a.codec_encode_seconds = {{"dc/dispatch", 0.0018}, {"dc/dense_grad", 0.0005}};
  a.codec_decode_seconds = {{"dc/dispatch", 0.0002}, {"dc/dense_grad", 0.0005}};
  b.codec_encode_seconds = {{"dc/dispatch", 0.0010}, {"dc/expert_gather", 0.003}};
  b.codec_decode_seconds = {{"dc/dispatch", 0.0020}, {"dc/expert_gather", 0.001}};
  a.nmse = {{"dc/dispatch", 2e-5}};
  b.nmse = {{"dc/dispatch", 1e-5}, {"dc/dense_grad", 3e-7}};
  metrics.record(0, a);
  metrics.record(1, b);
  const StepSummary& s = *metrics.last_complete();
  ASSERT_EQ(s.codec_seconds.size(), 3u);
  EXPECT_DOUBLE_EQ(s.codec_seconds.at("dc/dense_grad"), 0.001);
  EXPECT_DOUBLE_EQ(s.codec_seconds.at("dc/dispatch"), 0.003);
  EXPECT_DOUBLE_EQ(s.codec_seconds.at("dc/expert_gather"), 0.004);
  EXPECT_DOUBLE_EQ(s.nmse.at("dc/dispatch"), 2e-5);
  using Seconds = std::map<std::string, double>;
  EXPECT_EQ(s.codec_encode_seconds,
            (Seconds{{"dc/dense_grad", 0.0005}, {"dc/dispatch", 0.0018}, {"dc/expert_gather", 0.003}}));
  EXPECT_EQ(s.codec_decode_seconds,
            (Seconds{{"dc/dense_grad", 0.0005}, {"dc/dispatch", 0.002}, {"dc/expert_gather", 0.001}}));
  const std::string text = metrics.prometheus("j", {"running", "running"});
  EXPECT_NE(text.find("xdmoe_codec_encode_seconds{job=\"j\",link=\"dc\",traffic=\"dispatch\"} 0.0018\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_codec_decode_seconds{job=\"j\",link=\"dc\",traffic=\"dispatch\"} 0.002\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_codec_traffic_seconds{job=\"j\",link=\"dc\",traffic=\"dispatch\"} 0.003\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("xdmoe_codec_nmse{job=\"j\",link=\"dc\",traffic=\"dense_grad\"} 3e-07\n"), std::string::npos)
      << text;
  // Link class names come from the job config: label values are escaped.
  JobMetrics quoted(1);
  StepMetrics q = report(1, 0.4, 0.5);
  q.codec_encode_seconds = {{"d\"c\\/dispatch", 0.001}};
  quoted.record(0, q);
  const std::string escaped = quoted.prometheus("a\"b", {"running"});
  EXPECT_NE(escaped.find("xdmoe_codec_traffic_seconds{job=\"a\\\"b\",link=\"d\\\"c\\\\\",traffic=\"dispatch\"} 0.001\n"),
            std::string::npos)
      << escaped;
  // A step that spent nothing on a key counts 0 in the mean.
  StepMetrics c = report(2, 0.4, 0.5), d = report(2, 0.3, 0.2);
  c.codec_encode_seconds = {{"dc/dispatch", 0.001}};
  metrics.record(0, c);
  metrics.record(1, d);
  const StepSummary mean = metrics.mean(0);
  EXPECT_DOUBLE_EQ(mean.codec_seconds.at("dc/dispatch"), 0.002);
  EXPECT_DOUBLE_EQ(mean.codec_seconds.at("dc/expert_gather"), 0.002);
  EXPECT_DOUBLE_EQ(mean.codec_encode_seconds.at("dc/expert_gather"), 0.0015);
}

// The critical path runs through the slowest worker's compute: its own waits
// are the communication the schedule left exposed. The faster workers' waits
// also hold the time they spent waiting out its compute.
TEST(JobMetrics, TheCriticalOverlapIsTheSlowestWorkersWhateverOrderTheReportsCameIn) {
  JobMetrics metrics(3);
  StepMetrics fast = report(1, 0.30, 0.2), slow = report(1, 0.42, 0.2), middle = report(1, 0.35, 0.2);
  fast.fwd_comm_s = 0.2, fast.fwd_exposed_s = 0.10, fast.bwd_comm_s = 0.4, fast.bwd_exposed_s = 0.12;
  slow.fwd_comm_s = 0.2, slow.fwd_exposed_s = 0.01, slow.bwd_comm_s = 0.4, slow.bwd_exposed_s = 0.02;
  middle.fwd_comm_s = 0.2, middle.fwd_exposed_s = 0.05, middle.bwd_comm_s = 0.4, middle.bwd_exposed_s = 0.06;
  metrics.record(2, middle);
  metrics.record(1, slow);
  metrics.record(0, fast);
  const StepSummary& s = *metrics.last_complete();
  EXPECT_DOUBLE_EQ(s.fwd_exposed_s, 0.10) << "the most-waiting worker's, as before";
  EXPECT_DOUBLE_EQ(s.critical_fwd_exposed_s, 0.01);
  EXPECT_DOUBLE_EQ(s.critical_bwd_exposed_s, 0.02);
  EXPECT_DOUBLE_EQ(s.critical_fwd_overlap_percent(), 95.0);
  EXPECT_DOUBLE_EQ(s.critical_bwd_overlap_percent(), 95.0);
  EXPECT_DOUBLE_EQ(s.bwd_overlap_percent(), 70.0);
  StepMetrics later = report(2, 0.5, 0.2);  // step 2: one worker, slowest by construction
  later.bwd_comm_s = 0.4, later.bwd_exposed_s = 0.2;
  for (int rank = 0; rank < 3; ++rank) {
    StepMetrics m = rank == 1 ? later : report(2, 0.3, 0.2);
    if (rank != 1) m.bwd_comm_s = 0.4;
    metrics.record(rank, m);
  }
  EXPECT_DOUBLE_EQ(metrics.last_complete()->critical_bwd_exposed_s, 0.2);
  EXPECT_DOUBLE_EQ(metrics.mean(0).critical_bwd_exposed_s, 0.11);
  const std::string text = metrics.prometheus("j", {"running", "running", "running"});
  EXPECT_NE(text.find("xdmoe_direction_critical_overlap_percent{job=\"j\",direction=\"backward\"} 50\n"),
            std::string::npos) << text;
}

// Where the step's critical path waits: the slowest worker's waits by what
// for, kept whole (not mixed with the faster workers'), averaged over steps.
TEST(JobMetrics, TheWaitsByWhatForAreTheSlowestWorkersAndTheirMeanOverSteps) {
  JobMetrics metrics(2);
  StepMetrics fast = report(1, 0.30, 0.2), slow = report(1, 0.42, 0.2);
  fast.waits_s = {{step_waits::kForwardTokenExchange, 0.09}, {step_waits::kBackwardDenseAllReduce, 0.05}};
  slow.waits_s = {{step_waits::kForwardExpertAllGather, 0.004}, {step_waits::kBackwardGradientNorm, 0.012}};
  metrics.record(0, fast);
  metrics.record(1, slow);
  EXPECT_EQ(metrics.last_complete()->critical_waits_s, slow.waits_s);
  StepMetrics a = report(2, 0.5, 0.2), b = report(2, 0.3, 0.2);
  a.waits_s = {{step_waits::kBackwardGradientNorm, 0.006}};
  metrics.record(1, b);
  metrics.record(0, a);
  const StepSummary mean = metrics.mean(0);
  EXPECT_DOUBLE_EQ(mean.critical_waits_s.at(step_waits::kBackwardGradientNorm), 0.009);
  EXPECT_DOUBLE_EQ(mean.critical_waits_s.at(step_waits::kForwardExpertAllGather), 0.002)
      << "a step that did not wait for it counts as 0";
  EXPECT_EQ(waits_text(mean.critical_waits_s), "forward: expert all gather 2.0; backward: gradient norm 9.0");
  EXPECT_EQ(waits_text({{step_waits::kForwardTokenExchange, 1e-5}}), "") << "under 0.05 ms is left out";
  const std::string text = metrics.prometheus("j", {"running", "running"});
  EXPECT_NE(text.find("xdmoe_critical_wait_seconds{job=\"j\",direction=\"backward\",wait=\"gradient_norm\"} 0.006\n"),
            std::string::npos) << text;
  EXPECT_NE(metrics.to_json()["last_step"]["critical_waits_s"].dump().find("gradient_norm"), std::string::npos);
}

}  // namespace
}  // namespace xd
