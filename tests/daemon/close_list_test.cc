// CloseList: exactly the marked sessions come back, each once, in marking
// order, with the latest reason; nothing else is examined.
#include "daemon/close_list.h"

#include <gtest/gtest.h>

#include <memory>
#include <string_view>
#include <vector>

namespace kvtier {
namespace {

TEST(CloseListTest, TakesExactlyTheMarkedSessionsOnceEach) {
  std::vector<std::unique_ptr<Session>> sessions;
  for (uint64_t i = 0; i < 1000; ++i) {
    sessions.push_back(std::make_unique<Session>(8));
    sessions.back()->id = 16 + i;
  }
  CloseList list;
  EXPECT_TRUE(list.empty());
  list.Mark(*sessions[500], "malformed message");
  list.Mark(*sessions[7], "client closed the connection");
  list.Mark(*sessions[500], "send failed");  // marked again: listed once
  EXPECT_FALSE(list.empty());
  EXPECT_EQ(list.Take(), (std::vector<uint64_t>{16 + 500, 16 + 7}));
  EXPECT_EQ(std::string_view(sessions[500]->close_reason()), "send failed");
  EXPECT_EQ(std::string_view(sessions[7]->close_reason()), "client closed the connection");
  EXPECT_EQ(sessions[8]->close_reason(), nullptr);
  EXPECT_TRUE(list.empty());
  EXPECT_TRUE(list.Take().empty());
  // A session already taken (and so being closed) is not listed again.
  list.Mark(*sessions[7], "receive failed");
  EXPECT_TRUE(list.Take().empty());
}

}  // namespace
}  // namespace kvtier
