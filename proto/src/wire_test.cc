#include "tandem/proto/wire.h"

#include <cstdint>
#include <limits>
#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/proto/kv_layout_check.h"

namespace tandem::proto {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

void ExpectSameParams(const engine::SamplingParams& a, const engine::SamplingParams& b) {
  EXPECT_EQ(a.temperature, b.temperature);
  EXPECT_EQ(a.top_p, b.top_p);
  EXPECT_EQ(a.top_k, b.top_k);
  EXPECT_EQ(a.min_p, b.min_p);
  EXPECT_EQ(a.repetition_penalty, b.repetition_penalty);
  EXPECT_EQ(a.presence_penalty, b.presence_penalty);
  EXPECT_EQ(a.frequency_penalty, b.frequency_penalty);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.max_tokens, b.max_tokens);
  EXPECT_EQ(a.min_tokens, b.min_tokens);
  EXPECT_EQ(a.ignore_eos, b.ignore_eos);
  EXPECT_EQ(a.stop_token_ids, b.stop_token_ids);
  EXPECT_EQ(a.stop, b.stop);
  EXPECT_EQ(a.include_stop_str_in_output, b.include_stop_str_in_output);
  EXPECT_EQ(a.n, b.n);
  EXPECT_EQ(a.logprobs, b.logprobs);
  EXPECT_EQ(a.skip_special_tokens, b.skip_special_tokens);
  EXPECT_EQ(a.structured, b.structured);
  EXPECT_EQ(a.logit_bias, b.logit_bias);
}

// Through the wire format, as a worker receives it.
engine::SamplingParams OverTheWire(const engine::SamplingParams& params) {
  std::string bytes;
  EXPECT_TRUE(ToProto(params).SerializeToString(&bytes));
  tandem::v1::SamplingParams received;
  EXPECT_TRUE(received.ParseFromString(bytes));
  return FromProto(received);
}

// Every field away from its default, so a field the conversion forgets is caught.
engine::SamplingParams AllFieldsSet() {
  engine::SamplingParams p;
  p.temperature = 0.7f;
  p.top_p = 0.9f;
  p.top_k = 40;
  p.min_p = 0.05f;
  p.repetition_penalty = 1.1f;
  p.presence_penalty = -0.5f;
  p.frequency_penalty = 1.5f;
  p.seed = 0xdeadbeefcafef00dull;
  p.max_tokens = 321;
  p.min_tokens = 7;
  p.ignore_eos = true;
  p.stop_token_ids = {2, 128001, 0};
  p.stop = {"\n\n", "END"};
  p.include_stop_str_in_output = true;
  p.n = 3;
  p.logprobs = 5;
  p.skip_special_tokens = false;
  p.structured = {engine::ConstraintKind::kJsonSchema, R"({"type":"object"})", 4};
  p.logit_bias = {{5, -100.0f}, {128000, 2.5f}};
  return p;
}

TEST(SamplingParamsConvertTest, RoundTripKeepsEveryField) {
  engine::SamplingParams sent = AllFieldsSet();
  ExpectSameParams(OverTheWire(sent), sent);
}

TEST(SamplingParamsConvertTest, RoundTripKeepsEveryConstraintKind) {
  for (auto kind : {engine::ConstraintKind::kJsonSchema, engine::ConstraintKind::kJsonObject,
                    engine::ConstraintKind::kRegex, engine::ConstraintKind::kGrammar}) {
    engine::SamplingParams sent;
    sent.structured.kind = kind;
    if (kind != engine::ConstraintKind::kJsonObject) sent.structured.source = "[a-z]+";
    EXPECT_EQ(OverTheWire(sent).structured, sent.structured) << engine::ConstraintKindName(kind);
  }
  EXPECT_FALSE(ToProto(engine::SamplingParams{}).has_structured_output());
}

TEST(SamplingParamsConvertTest, AConstraintKindFromANewerPeerIsRefusedNotDropped) {
  tandem::v1::SamplingParams wire;
  wire.mutable_structured_output()->set_kind(static_cast<tandem::v1::StructuredOutput::Kind>(9));
  wire.mutable_structured_output()->set_source("x");
  engine::SamplingParams params = FromProto(wire);
  EXPECT_TRUE(params.structured.active());
  EXPECT_THAT(params.structured.Validate(10).message(), HasSubstr("unknown kind 9"));
}

TEST(SamplingParamsConvertTest, RoundTripKeepsDefaults) {
  ExpectSameParams(OverTheWire(engine::SamplingParams{}), engine::SamplingParams{});
}

TEST(SamplingParamsConvertTest, UnsetSeedStaysUnsetAndSeedZeroStaysZero) {
  engine::SamplingParams unseeded;
  EXPECT_FALSE(ToProto(unseeded).has_seed());
  EXPECT_EQ(OverTheWire(unseeded).seed, std::nullopt);

  engine::SamplingParams seeded_zero;
  seeded_zero.seed = 0;
  EXPECT_TRUE(ToProto(seeded_zero).has_seed());
  EXPECT_EQ(OverTheWire(seeded_zero).seed, std::optional<uint64_t>(0));

  engine::SamplingParams seeded_max;
  seeded_max.seed = std::numeric_limits<uint64_t>::max();
  EXPECT_EQ(OverTheWire(seeded_max).seed, seeded_max.seed);
}

TEST(SamplingParamsConvertTest, UnicodeStopStringsSurviveByteForByte) {
  engine::SamplingParams p;
  p.stop = {"\xC3\xA9t\xC3\xA9",      // "été"
            "\xE3\x80\x82",           // "。"
            "\xF0\x9F\x9B\x91 stop",  // "🛑 stop" (4-byte UTF-8)
            "e\xCC\x81"};             // "é" as e + combining acute: not normalised
  EXPECT_THAT(OverTheWire(p).stop, ElementsAre("\xC3\xA9t\xC3\xA9", "\xE3\x80\x82",
                                               "\xF0\x9F\x9B\x91 stop", "e\xCC\x81"));
}

TEST(SamplingParamsConvertTest, EmptyMessageMeansEngineDefaultsNotZeros) {
  // A sender that sets nothing must get temperature 1 (not greedy), top_p 1, n 1, no logprobs.
  engine::SamplingParams p = FromProto(tandem::v1::SamplingParams{});
  ExpectSameParams(p, engine::SamplingParams{});
  EXPECT_FALSE(p.greedy());
  EXPECT_EQ(p.logprobs, -1);
}

TEST(SamplingParamsConvertTest, ExplicitZerosAreKept) {
  tandem::v1::SamplingParams msg;
  msg.set_temperature(0.0f);
  msg.set_logprobs(0);
  msg.set_skip_special_tokens(false);
  engine::SamplingParams p = FromProto(msg);
  EXPECT_TRUE(p.greedy());
  EXPECT_EQ(p.logprobs, 0);
  EXPECT_FALSE(p.skip_special_tokens);
  EXPECT_EQ(p.max_tokens, engine::SamplingParams{}.max_tokens);
}

TEST(StatusConvertTest, EveryCanonicalCodeAndMessageCrossesGrpc) {
  for (int code = 1; code <= 16; ++code) {
    absl::Status status(static_cast<absl::StatusCode>(code), "why " + std::to_string(code));
    grpc::Status wire = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(wire.error_code()), code);
    EXPECT_EQ(wire.error_message(), "why " + std::to_string(code));
    EXPECT_EQ(FromGrpcStatus(wire), status);
  }
}

TEST(StatusConvertTest, NamedCodesMatch) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  EXPECT_EQ(ToGrpcStatus(absl::FailedPreconditionError("x")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("x")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone")),
            absl::UnavailableError("gone"));
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::CANCELLED, "")).code(),
            absl::StatusCode::kCancelled);
}

TEST(StatusConvertTest, ErrorStatusRoundTrip) {
  absl::Status status = absl::NotFoundError("reservation r7 expired");
  tandem::v1::ErrorStatus msg = ToProto(status);
  EXPECT_EQ(msg.code(), 5);
  EXPECT_EQ(FromProto(msg), status);
  EXPECT_EQ(ToProto(absl::OkStatus()).code(), 0);
  EXPECT_TRUE(FromProto(tandem::v1::ErrorStatus{}).ok());
}

TEST(StatusConvertTest, UnknownCodeFromNewerPeerIsUnknownAndNamed) {
  tandem::v1::ErrorStatus msg;
  msg.set_code(42);
  msg.set_message("new failure");
  absl::Status status = FromProto(msg);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnknown);
  EXPECT_THAT(std::string(status.message()), HasSubstr("42"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("new failure"));
}

TEST(PrefilledChoiceConvertTest, RoundTripKeepsTheRandomStreamBitForBit) {
  engine::PrefillHandoff h;
  h.first_token = 42;
  h.first_logprob = -1.25f;
  h.first_top_logprobs = {{42, -1.25f}, {7, -2.5f}};
  h.rng_state = {0x0123456789abcdefull, ~0ull, 0, 0x8000000000000001ull};
  tandem::v1::PrefilledChoice wire = ToProto(3, h);
  EXPECT_EQ(wire.index(), 3);
  absl::StatusOr<engine::PrefilledChoice> back = FromProto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->first_token, 42);
  EXPECT_EQ(back->first_logprob, -1.25f);
  ASSERT_EQ(back->first_top_logprobs.size(), 2u);
  EXPECT_EQ(back->first_top_logprobs[1].token, 7);
  EXPECT_EQ(back->rng_state, h.rng_state);
  wire.mutable_sampler_state()->pop_back();
  EXPECT_EQ(FromProto(wire).status().code(), absl::StatusCode::kInvalidArgument);
  // Greedy samples may leave the state out: it reads as all zeros.
  wire.clear_sampler_state();
  back = FromProto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rng_state, (std::array<uint64_t, 4>{0, 0, 0, 0}));
}

// A Submit's task crosses the wire both ways; an older router's Submit (no task) is a generation,
// and a task from a newer router is refused rather than run as something else.
TEST(RequestTaskConvertTest, RoundTripAndUnknownTasks) {
  for (engine::RequestTask task : {engine::RequestTask::kGenerate, engine::RequestTask::kEmbed}) {
    absl::StatusOr<engine::RequestTask> back = FromProto(ToProto(task));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, task);
  }
  EXPECT_EQ(ToProto(engine::RequestTask::kEmbed), tandem::v1::TASK_EMBED);
  EXPECT_EQ(*FromProto(tandem::v1::SubmitRequest().task()), engine::RequestTask::kGenerate);
  absl::StatusOr<engine::RequestTask> unknown = FromProto(static_cast<tandem::v1::Task>(9));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("9"));
}

// Every KV element type has its own name in the handshake, and two engines whose caches differ
// only in element type are refused with both named.
TEST(KvLayoutConvertTest, TheCacheDtypeCrossesTheHandshake) {
  text::ModelConfig config;
  config.num_layers = 4;
  config.num_kv_heads = 2;
  config.head_dim = 64;
  std::set<int> names;
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2}) {
    const tandem::v1::KvLayout wire = EngineKvLayout(config, 16, d);
    EXPECT_TRUE(ValidateLayout(wire).ok()) << DTypeName(d);
    names.insert(wire.dtype());
  }
  EXPECT_EQ(names.size(), 5u);
  const tandem::v1::KvLayout prefill = EngineKvLayout(config, 16, DType::kBF16);
  const absl::Status status =
      CheckLayoutCompatible(prefill, EngineKvLayout(config, 16, DType::kF8E5M2));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("dtype BF16 vs FP8_E5M2"));
}

}  // namespace
}  // namespace tandem::proto
