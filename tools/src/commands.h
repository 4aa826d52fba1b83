// Entry points of the `tandem` subcommands. Each returns the process exit code and prints a
// one-line reason on stderr when it fails.
#pragma once

namespace tandem::tools {

int RunTokenize(int argc, char** argv);
int RunSynthModel(int argc, char** argv);
int RunGenerate(int argc, char** argv);
int RunServe(int argc, char** argv);
int RunRoofline(int argc, char** argv);
int RunBench(int argc, char** argv);
int RunRouter(int argc, char** argv);
int RunPrefill(int argc, char** argv);
int RunDecode(int argc, char** argv);
int RunPlan(int argc, char** argv);

}  // namespace tandem::tools
