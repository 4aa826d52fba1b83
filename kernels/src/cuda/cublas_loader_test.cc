// cuBLAS is loaded on first use, not linked: this test binary links the CUDA backend and yet has
// no libcublas mapped until LoadCublas. Loading and resolving needs no GPU.
#include "kernels/src/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tandem/kernels/cuda_backend.h"

namespace tandem::kernels::cuda {
namespace {

bool Mapped(const std::string& name) {
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  dlclose(lib);  // the reference RTLD_NOLOAD took
  return true;
}

TEST(CublasLoaderTest, LoadsOnFirstUseOnly) {
  const std::string cublas = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
  const std::string cublas_lt = absl::StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR);
  // Linked with the CUDA backend (CreateCudaBackend), yet nothing of cuBLAS is mapped.
  ASSERT_NE(reinterpret_cast<void*>(&CreateCudaBackend), nullptr);
  EXPECT_FALSE(Mapped(cublas));
  EXPECT_FALSE(Mapped(cublas_lt));

  absl::StatusOr<const CublasApi*> api = LoadCublas();
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_TRUE(Mapped(cublas));
  for (const void* fn : {reinterpret_cast<const void*>((*api)->create),
                         reinterpret_cast<const void*>((*api)->destroy),
                         reinterpret_cast<const void*>((*api)->set_stream),
                         reinterpret_cast<const void*>((*api)->set_math_mode),
                         reinterpret_cast<const void*>((*api)->sgemm)}) {
    EXPECT_NE(fn, nullptr);
  }
  // An entry point that runs without a device.
  EXPECT_STREQ((*api)->status_name(CUBLAS_STATUS_NOT_INITIALIZED),
               "CUBLAS_STATUS_NOT_INITIALIZED");
  // Loaded once: the same table again.
  absl::StatusOr<const CublasApi*> again = LoadCublas();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *api);
}

}  // namespace
}  // namespace tandem::kernels::cuda
