// Tests of the workers' KvEvents service: one stream read as the router reads it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::worker_testing {

class KvEventsStream {
 public:
  // Opens the stream on a prefill or decode worker's stub.
  template <typename Stub>
  explicit KvEventsStream(Stub& stub)
      : reader_(stub.KvEvents(&context_, tandem::v1::KvEventsRequest())) {}

  // The first batch, which must be a snapshot: the hashes cached when the stream opened, and
  // the worker's block size (> 0).
  ::testing::AssertionResult ReadSnapshot(std::set<uint64_t>* stored, int* block_size) {
    tandem::v1::KvEventBatch batch;
    if (!reader_->Read(&batch)) return ::testing::AssertionFailure() << "the stream ended";
    if (!batch.reset()) return ::testing::AssertionFailure() << "the first batch is no snapshot";
    if (batch.block_size() <= 0) {
      return ::testing::AssertionFailure() << "block size " << batch.block_size();
    }
    if (batch.removed_size() != 0) {
      return ::testing::AssertionFailure() << "a snapshot removes " << batch.removed_size();
    }
    stored->insert(batch.stored().begin(), batch.stored().end());
    *block_size = batch.block_size();
    return ::testing::AssertionSuccess();
  }

  // Reads batches until `want` has been stored (or the stream ends); each must store only,
  // neither reset nor remove. Returns every hash stored meanwhile.
  std::set<uint64_t> ReadUntilStored(const std::set<uint64_t>& want) {
    std::set<uint64_t> stored;
    tandem::v1::KvEventBatch batch;
    while (!std::includes(stored.begin(), stored.end(), want.begin(), want.end()) &&
           reader_->Read(&batch)) {
      EXPECT_FALSE(batch.reset());
      EXPECT_EQ(batch.removed_size(), 0);
      stored.insert(batch.stored().begin(), batch.stored().end());
    }
    return stored;
  }

  // Reads to the end; the stream's final status.
  grpc::Status Finish() {
    tandem::v1::KvEventBatch batch;
    while (reader_->Read(&batch)) {
    }
    return reader_->Finish();
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<tandem::v1::KvEventBatch>> reader_;
};

}  // namespace tandem::worker_testing
