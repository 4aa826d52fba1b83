#include "tandem/worker/kv_endpoint.h"

#include <cstring>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_models.h"

namespace tandem::worker {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<engine::LlmEngine> TinyEngine(int64_t kv_bytes = 1 << 20) {
  engine::EngineOptions options;
  options.model_dir = testing::TinyModel("qwen3", DType::kBF16);
  options.num_threads = 1;
  options.kv_cache_bytes = kv_bytes;
  auto engine = engine::LlmEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

std::unique_ptr<KvEndpoint> Endpoint(engine::LlmEngine& engine, const std::string& name,
                                     const std::string& role) {
  auto endpoint = KvEndpoint::Create({.backend = "local", .name = name, .role = role}, engine);
  EXPECT_TRUE(endpoint.ok()) << endpoint.status();
  return endpoint.ok() ? std::move(endpoint).value() : nullptr;
}

TEST(KvEndpointTest, DescribesTheWholeCacheAsOneRegion) {
  auto engine = TinyEngine();
  auto kv = Endpoint(*engine, "decode-a", "decode");
  const tandem::v1::TransferEndpoint endpoint = kv->Describe();
  EXPECT_EQ(endpoint.backend(), "local");
  EXPECT_FALSE(endpoint.address().empty());
  EXPECT_EQ(endpoint.region_descriptors_size(), 1);
  EXPECT_EQ(endpoint.num_blocks(), engine->cache_layout().num_blocks);
  EXPECT_EQ(endpoint.layout().SerializeAsString(), kv->layout().SerializeAsString());
  EXPECT_EQ(kv->layout().num_layers(), engine->cache_layout().num_layers);
  EXPECT_EQ(kv->layout().block_size(), engine->cache_layout().block_size);
}

TEST(KvEndpointTest, HandshakeChecksTheLayoutInTheDirectionPagesGo) {
  auto engine = TinyEngine();
  auto kv = Endpoint(*engine, "decode-a", "decode");
  tandem::v1::HandshakeRequest hello;
  hello.set_worker_id("prefill-b");
  *hello.mutable_layout() = kv->layout();
  for (bool sends : {false, true}) {
    auto ok = kv->Handshake(hello, "decode-a", sends);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(ok->worker_id(), "decode-a");
    EXPECT_EQ(ok->layout().SerializeAsString(), kv->layout().SerializeAsString());
  }
  hello.mutable_layout()->set_head_dim(kv->layout().head_dim() * 2);
  // The sender's value comes first in the message, and both workers are named in order.
  auto receiving = kv->Handshake(hello, "decode-a", /*this_side_sends=*/false);
  EXPECT_EQ(receiving.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(receiving.status().message(),
              HasSubstr(absl::StrCat("head_dim ", kv->layout().head_dim() * 2, " vs ",
                                     kv->layout().head_dim())));
  EXPECT_THAT(receiving.status().message(), HasSubstr("(worker prefill-b -> decode-a)"));
  auto sending = kv->Handshake(hello, "decode-a", /*this_side_sends=*/true);
  EXPECT_EQ(sending.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(sending.status().message(),
              HasSubstr(absl::StrCat("head_dim ", kv->layout().head_dim(), " vs ",
                                     kv->layout().head_dim() * 2)));
  EXPECT_THAT(sending.status().message(), HasSubstr("(worker decode-a -> prefill-b)"));
}

TEST(KvEndpointTest, RefusesAReceiverOnAnotherBackendOrLayout) {
  auto engine = TinyEngine();
  auto kv = Endpoint(*engine, "prefill-a", "prefill");
  tandem::v1::TransferEndpoint receiver = kv->Describe();
  EXPECT_TRUE(kv->CheckReceiver(receiver, "reservation.endpoint").ok());
  receiver.set_backend("ucx");
  absl::Status other = kv->CheckReceiver(receiver, "reservation.endpoint");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.message(), HasSubstr("this prefill worker"));
  receiver = kv->Describe();
  receiver.mutable_layout()->set_num_layers(99);
  EXPECT_THAT(kv->CheckReceiver(receiver, "reservation.endpoint").message(),
              HasSubstr("num_layers"));
}

TEST(KvEndpointTest, PushesBytesIntoThePeersCacheOverOneReusedConnection) {
  auto sender_engine = TinyEngine();
  auto receiver_engine = TinyEngine(2 << 20);  // differs in size only
  auto sender = Endpoint(*sender_engine, "prefill-a", "prefill");
  auto receiver = Endpoint(*receiver_engine, "decode-b", "decode");
  const tandem::v1::TransferEndpoint there = receiver->Describe();
  ASSERT_TRUE(sender->CheckReceiver(there, "endpoint").ok());

  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto peer = sender->Peer(there.address(), deadline);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto again = sender->Peer(there.address(), deadline);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *peer);  // cached

  // Block 1, layer 0, K of the sender into block 3 of the receiver.
  const engine::KvCacheLayout& src = sender->cache_layout();
  engine::KvCacheLayout dst = src;
  dst.num_blocks = there.num_blocks();
  const uint64_t bytes = src.block_bytes();
  auto* from = reinterpret_cast<unsigned char*>(sender_engine->kv_cache());
  auto* to = reinterpret_cast<unsigned char*>(receiver_engine->kv_cache());
  for (uint64_t i = 0; i < bytes; ++i)
    from[src.Offset(0, 0, 1, 0) + i] = static_cast<unsigned char>(i * 7 + 1);
  auto handle = sender->Push(*peer, there.region_descriptors(0),
                             {{src.Offset(0, 0, 1, 0), dst.Offset(0, 0, 3, 0), bytes}}, deadline);
  ASSERT_TRUE(handle.ok()) << handle.status();
  ASSERT_TRUE((*handle)->Wait().ok());
  EXPECT_EQ(std::memcmp(from + src.Offset(0, 0, 1, 0), to + dst.Offset(0, 0, 3, 0), bytes), 0);

  // A dropped connection is forgotten: the next Peer connects afresh, as does `fresh`.
  sender->DropPeer(there.address(), *peer);
  auto reconnected = sender->Peer(there.address(), deadline);
  ASSERT_TRUE(reconnected.ok());
  EXPECT_NE(*reconnected, *peer);
  auto fresh = sender->Peer(there.address(), deadline, /*fresh=*/true);
  ASSERT_TRUE(fresh.ok());
  EXPECT_NE(*fresh, *reconnected);

  sender->Close();
  sender->Close();  // idempotent
}

TEST(KvEndpointTest, RefusesAnUnknownBackend) {
  auto engine = TinyEngine();
  auto endpoint =
      KvEndpoint::Create({.backend = "carrier-pigeon", .name = "x", .role = "decode"}, *engine);
  EXPECT_EQ(endpoint.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::worker
