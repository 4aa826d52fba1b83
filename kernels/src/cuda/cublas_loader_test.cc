// cuBLAS is loaded on first use, not linked: this test binary links the CUDA backend and yet has
// no libcublas mapped until LoadCublas. Loading and resolving needs no GPU.
#include "kernels/src/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/src/cuda/gemm_lt.h"
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

// After LoadsOnFirstUseOnly (declaration order): cuBLASLt, whose descriptors need no device.
TEST(CublasLoaderTest, LoadsCublasLt) {
  absl::StatusOr<const CublasLtApi*> api = LoadCublasLt();
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_TRUE(Mapped(absl::StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR)));
  const CublasLtApi& lt = **api;
  cublasLtMatmulDesc_t desc = nullptr;
  ASSERT_EQ(lt.desc_create(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  EXPECT_EQ(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(lt.desc_destroy(desc), CUBLAS_STATUS_SUCCESS);
  cublasLtMatrixLayout_t layout = nullptr;
  ASSERT_EQ(lt.layout_create(&layout, CUDA_R_16BF, 4096, 8, 4096), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(lt.layout_destroy(layout), CUBLAS_STATUS_SUCCESS);
  EXPECT_STREQ(lt.status_name(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  for (const void* fn :
       {reinterpret_cast<const void*>(lt.create), reinterpret_cast<const void*>(lt.destroy),
        reinterpret_cast<const void*>(lt.preference_create),
        reinterpret_cast<const void*>(lt.preference_set),
        reinterpret_cast<const void*>(lt.preference_destroy),
        reinterpret_cast<const void*>(lt.heuristic), reinterpret_cast<const void*>(lt.matmul)}) {
    EXPECT_NE(fn, nullptr);
  }
  absl::StatusOr<const CublasLtApi*> again = LoadCublasLt();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *api);
}

TEST(LtGemmTest, BucketsAndAlignment) {
  EXPECT_EQ(LtGemm::BucketRows(5), 8);
  EXPECT_EQ(LtGemm::BucketRows(8), 8);
  EXPECT_EQ(LtGemm::BucketRows(9), 16);
  EXPECT_EQ(LtGemm::BucketRows(2048), 2048);
  EXPECT_EQ(LtGemm::BucketRows(2049), 4096);
  EXPECT_EQ(LtGemm::BucketRows(100000), 131072);

  alignas(16) static unsigned char bytes[64];
  const void* aligned[] = {bytes, bytes + 32, nullptr};
  EXPECT_EQ(LtGemm::Alignment(aligned, 3), 16);
  const void* off4[] = {bytes, bytes + 36};
  EXPECT_EQ(LtGemm::Alignment(off4, 2), 4);
  const void* off2[] = {bytes + 8, bytes + 2};
  EXPECT_EQ(LtGemm::Alignment(off2, 2), 2);
  const void* off8[] = {bytes + 8};
  EXPECT_EQ(LtGemm::Alignment(off8, 1), 8);
}

TEST(LtGemmTest, CreateWithoutADeviceSaysWhy) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  unsigned char workspace[16];
  absl::StatusOr<std::unique_ptr<LtGemm>> lt = LtGemm::Create(workspace, sizeof(workspace));
  ASSERT_FALSE(lt.ok());
  EXPECT_NE(lt.status().message().find("cublasLtCreate"), std::string::npos) << lt.status();
}

}  // namespace
}  // namespace tandem::kernels::cuda
