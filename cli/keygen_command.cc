// xdmoe keygen: CURVE key pairs for cluster.security (docs/operations.md).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "transport/security.h"

namespace xd::cli {

namespace {
struct KeygenFlags {
  std::string dir = "keys";
  std::vector<std::string> names;
};

int run_keygen(const KeygenFlags& f) {
  for (const std::string& name : f.names) {
    auto keys = generate_curve_keys();
    if (!keys) {
      std::fprintf(stderr, "xdmoe keygen: %s\n", keys.status().message().c_str());
      return 1;
    }
    if (Status st = write_curve_key_files(f.dir, name, *keys); !st.is_ok()) {
      std::fprintf(stderr, "xdmoe keygen: %s\n", st.message().c_str());
      return 1;
    }
    // The public half only: a secret never reaches a terminal or a log.
    std::printf("%s/%s.key (secret, mode 0600) and %s/%s.pub: public key %s\n", f.dir.c_str(), name.c_str(),
                f.dir.c_str(), name.c_str(), keys->public_key.c_str());
  }
  std::printf("\nIn the job config, for example:\n"
              "cluster:\n  security:\n    coordinator_key: %s/%s.key\n    coordinator_public_key: %s/%s.pub\n"
              "    worker_key: %s/%s.key\n    allowed_keys: [",
              f.dir.c_str(), f.names[0].c_str(), f.dir.c_str(), f.names[0].c_str(), f.dir.c_str(),
              f.names[f.names.size() > 1 ? 1 : 0].c_str());
  for (size_t i = 1; i < f.names.size(); ++i) std::printf("%s%s/%s.pub", i > 1 ? ", " : "", f.dir.c_str(), f.names[i].c_str());
  if (f.names.size() == 1) std::printf("%s/%s.pub", f.dir.c_str(), f.names[0].c_str());
  std::printf("]\n");
  return 0;
}
}  // namespace

void add_keygen_command(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<KeygenFlags>();
  CLI::App* cmd = app.add_subcommand("keygen", "Write CURVE key pairs for encrypted, authenticated links "
                                               "(cluster.security; docs/operations.md)");
  cmd->add_option("names", f->names, "Key pair names, e.g. coordinator worker admin: NAME.key (secret) and NAME.pub")
      ->required();
  cmd->add_option("--dir", f->dir, "Where the key files go")->capture_default_str();
  cmd->callback([f, exit_code] { *exit_code = run_keygen(*f); });
}

}  // namespace xd::cli
