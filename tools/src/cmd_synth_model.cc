#include <cstdio>
#include "commands.h"
namespace tandem::tools {
int RunSynthModel(int, char**) { std::fprintf(stderr, "not built yet\n"); return 1; }
}  // namespace tandem::tools
