#include "token_stream.h"

#include <deque>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::decode_worker {
namespace {

using ::testing::ElementsAre;

tandem::v1::TokenEvent Tokens(int index, std::vector<int> ids, const std::string& text) {
  tandem::v1::TokenEvent event;
  event.set_request_id("r");
  event.set_index(index);
  for (int id : ids) {
    event.add_token_ids(id);
    event.add_logprobs(-0.5f * static_cast<float>(id));
  }
  event.set_text(text);
  return event;
}

std::vector<int> Ids(const tandem::v1::TokenEvent& event) {
  return {event.token_ids().begin(), event.token_ids().end()};
}

TEST(TokenStreamQueueTest, TokensOfASampleWaitingToBeWrittenMergeInOrder) {
  std::deque<tandem::v1::TokenEvent> queue;
  QueueEvent(queue, Tokens(0, {1}, "a"));
  QueueEvent(queue, Tokens(1, {7}, "x"));
  QueueEvent(queue, Tokens(0, {2, 3}, "bc"));
  QueueEvent(queue, Tokens(1, {8}, "y"));
  ASSERT_EQ(queue.size(), 2u);
  EXPECT_EQ(queue[0].index(), 0);
  EXPECT_THAT(Ids(queue[0]), ElementsAre(1, 2, 3));
  EXPECT_EQ(queue[0].text(), "abc");
  EXPECT_THAT(queue[0].logprobs(), ElementsAre(-0.5f, -1.0f, -1.5f));
  EXPECT_THAT(Ids(queue[1]), ElementsAre(7, 8));
  EXPECT_EQ(queue[1].text(), "xy");
}

TEST(TokenStreamQueueTest, AFinishedSampleTakesNothingMoreAndUsageStaysLast) {
  std::deque<tandem::v1::TokenEvent> queue;
  QueueEvent(queue, Tokens(0, {1}, "a"));
  tandem::v1::TokenEvent finish = Tokens(0, {2}, "b");
  finish.set_finish_reason(tandem::v1::FINISH_REASON_STOP);
  QueueEvent(queue, finish);  // merges: the sample's last event now carries the finish
  ASSERT_EQ(queue.size(), 1u);
  EXPECT_EQ(queue[0].finish_reason(), tandem::v1::FINISH_REASON_STOP);
  EXPECT_THAT(Ids(queue[0]), ElementsAre(1, 2));

  QueueEvent(queue, Tokens(0, {9}, "z"));  // after a finish: an event of its own
  ASSERT_EQ(queue.size(), 2u);
  EXPECT_THAT(Ids(queue[1]), ElementsAre(9));

  tandem::v1::TokenEvent last = Tokens(1, {5}, "q");
  last.set_finish_reason(tandem::v1::FINISH_REASON_LENGTH);
  last.mutable_usage()->set_completion_tokens(4);
  QueueEvent(queue, Tokens(1, {4}, "p"));
  QueueEvent(queue, last);  // carries usage: never merged, so it stays the last event
  ASSERT_EQ(queue.size(), 4u);
  EXPECT_TRUE(queue.back().has_usage());
  EXPECT_THAT(Ids(queue.back()), ElementsAre(5));
  QueueEvent(queue, Tokens(1, {6}, "r"));  // nothing merges into a closed event
  EXPECT_EQ(queue.size(), 5u);
}

TEST(TokenStreamQueueTest, ErrorsAndHandoffsAreNeverMerged) {
  std::deque<tandem::v1::TokenEvent> queue;
  QueueEvent(queue, Tokens(0, {1}, "a"));
  tandem::v1::TokenEvent error = Tokens(0, {}, "");
  error.mutable_error()->set_code(14);
  QueueEvent(queue, error);
  ASSERT_EQ(queue.size(), 2u);
  EXPECT_EQ(queue[1].error().code(), 14);
  tandem::v1::TokenEvent handoff = Tokens(1, {}, "");
  handoff.mutable_handoff()->set_worker_id("d");
  QueueEvent(queue, handoff);
  ASSERT_EQ(queue.size(), 3u);
  EXPECT_TRUE(queue[2].has_handoff());
}

}  // namespace
}  // namespace tandem::decode_worker
