#include "common/layer_gate.h"

#include <gtest/gtest.h>

#include <memory>
#include <utility>
#include <vector>

namespace kvtier {
namespace {

// What an opener was told, call by call.
struct Told {
  std::vector<std::pair<uint32_t, bool>> calls;
  LayerGate::Opener Opener() {
    return [this](uint32_t open, bool aborted) { calls.emplace_back(open, aborted); };
  }
};

using Calls = std::vector<std::pair<uint32_t, bool>>;

TEST(LayerGateTest, OpenersHearOfEveryRaiseOnlyAndNothingOnceEveryLayerIsOpen) {
  LayerGate gate(4);
  Told early;
  gate.Attach(early.Opener());
  EXPECT_TRUE(early.calls.empty()) << "nothing open yet";
  gate.Open(1);
  gate.Open(1);  // not more: not told
  gate.Open(0);
  gate.Open(3);
  Told late;
  gate.Attach(late.Opener());  // told at once of what is open
  gate.Open(99);  // capped at the layers
  gate.Open(4);
  gate.Abort();  // every layer open: not an abort
  EXPECT_EQ(early.calls, (Calls{{1, false}, {3, false}, {4, false}}));
  EXPECT_EQ(late.calls, (Calls{{3, false}, {4, false}}));
  EXPECT_EQ(gate.open(), 4u);
  EXPECT_FALSE(gate.aborted());
  Told after;
  gate.Attach(after.Opener());
  EXPECT_EQ(after.calls, (Calls{{4, false}}));
}

TEST(LayerGateTest, AnAbortIsTheLastWordAndALateOpenerHearsOfIt) {
  LayerGate gate(8);
  Told told;
  gate.Attach(told.Opener());
  gate.Open(2);
  gate.Abort();
  gate.Open(8);  // too late
  gate.Abort();
  EXPECT_EQ(told.calls, (Calls{{2, false}, {2, true}}));
  EXPECT_TRUE(gate.aborted());
  EXPECT_EQ(gate.open(), 2u);
  Told late;
  gate.Attach(late.Opener());
  EXPECT_EQ(late.calls, (Calls{{2, true}}));
}

TEST(LayerGateTest, AGateLetGoOfBeforeEveryLayerIsOpenAborts) {
  Told told;
  {
    auto gate = std::make_shared<LayerGate>(3);
    gate->Attach(told.Opener());
    gate->Open(1);
  }
  EXPECT_EQ(told.calls, (Calls{{1, false}, {1, true}}));
  Told whole;
  {
    LayerGate gate(2);
    gate.Attach(whole.Opener());
    gate.Open(2);
  }
  EXPECT_EQ(whole.calls, (Calls{{2, false}})) << "written whole: nothing to abort";
}

}  // namespace
}  // namespace kvtier
