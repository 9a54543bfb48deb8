// Feeds arbitrary text to the job config parsers (cluster/job_config.h):
// parse_job_config reads it as YAML, and, when it is JSON, job_config_from_json
// reads it as the JSON form a worker receives. Checks that a job either
// parser accepts is written by job_config_to_json as JSON that
// job_config_from_json accepts and that comes out unchanged: every job the
// coordinator can start must reach its workers.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "cluster/job_config.h"

namespace {

using nlohmann::json;

void check_round_trip(const xd::JobConfig& job, const char* from) {
  const json written = xd::job_config_to_json(job);
  xd::Expected<xd::JobConfig> back = xd::job_config_from_json(written);
  if (!back) {
    std::fprintf(stderr, "a job accepted from %s is refused as JSON: %s\n", from, back.status().to_string().c_str());
    std::abort();
  }
  // Compared as msgpack bytes, so that a NaN equals itself.
  if (json::to_msgpack(xd::job_config_to_json(*back)) != json::to_msgpack(written)) {
    std::fprintf(stderr, "a job accepted from %s changes in a JSON round trip: %s\n", from, written.dump().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  xd::Expected<xd::JobConfig> yaml = xd::parse_job_config(text, "fuzz.yaml");
  if (yaml) check_round_trip(*yaml, "YAML");
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  xd::Expected<xd::JobConfig> from_json = xd::job_config_from_json(j);
  if (from_json) check_round_trip(*from_json, "JSON");
  return 0;
}
