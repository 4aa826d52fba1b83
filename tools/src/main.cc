// `tandem`: one binary, one subcommand per role or tool.
#include <cstdio>
#include <cstring>
#include <string>

#include "commands.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* help;
};

constexpr Command kCommands[] = {
    {"bench", tandem::tools::RunBench, "load generator against an OpenAI-compatible endpoint"},
    {"decode", tandem::tools::RunDecode, "a decode worker (gRPC control plane, KV receiver)"},
    {"generate", tandem::tools::RunGenerate, "offline generation from a checkpoint"},
    {"plan", tandem::tools::RunPlan,
     "capacity planner: simulated placement search for goodput per GPU"},
    {"prefill", tandem::tools::RunPrefill, "a prefill worker (gRPC control plane, KV sender)"},
    {"roofline", tandem::tools::RunRoofline, "FLOPs, bytes and bound per operator, step times"},
    {"router", tandem::tools::RunRouter, "the OpenAI-compatible API over prefill and decode workers"},
    {"serve", tandem::tools::RunServe,
     "router + prefill + decode in one process (default: a demo model)"},
    {"synth-model", tandem::tools::RunSynthModel, "write a synthetic Hugging Face checkpoint"},
    {"tokenize", tandem::tools::RunTokenize, "tokenize (or --decode) lines from stdin"},
};

void PrintUsage(FILE* out) {
  std::fprintf(out, "usage: tandem <command> [flags]   (tandem <command> --help for flags)\n\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-14s %s\n", c.name, c.help);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    PrintUsage(stderr);
    return 2;
  }
  std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    PrintUsage(stdout);
    return 0;
  }
  for (const Command& c : kCommands) {
    if (name == c.name) return c.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "tandem: unknown command '%s' (see tandem --help)\n", name.c_str());
  return 2;
}
