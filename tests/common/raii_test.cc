#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <gtest/gtest.h>

#include "common/memory_mapping.h"
#include "common/unique_fd.h"

namespace kvtier {
namespace {

bool FdIsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

int OpenDevNull() {
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  return fd;
}

TEST(UniqueFdTest, ClosesOnDestruction) {
  const int raw = OpenDevNull();
  {
    UniqueFd fd(raw);
    EXPECT_TRUE(fd.valid());
    EXPECT_EQ(fd.get(), raw);
    EXPECT_TRUE(FdIsOpen(raw));
  }
  EXPECT_FALSE(FdIsOpen(raw));
}

TEST(UniqueFdTest, MoveTransfersOwnership) {
  const int raw = OpenDevNull();
  UniqueFd a(raw);
  UniqueFd b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_EQ(b.get(), raw);
  UniqueFd c;
  c = std::move(b);
  EXPECT_EQ(c.get(), raw);
  EXPECT_TRUE(FdIsOpen(raw));
  c.Reset();
  EXPECT_FALSE(FdIsOpen(raw));
}

TEST(UniqueFdTest, MoveAssignClosesPrevious) {
  const int first = OpenDevNull();
  const int second = OpenDevNull();
  UniqueFd a(first);
  a = UniqueFd(second);
  EXPECT_FALSE(FdIsOpen(first));
  EXPECT_TRUE(FdIsOpen(second));
}

TEST(UniqueFdTest, ReleaseDoesNotClose) {
  const int raw = OpenDevNull();
  int released = -1;
  {
    UniqueFd fd(raw);
    released = fd.Release();
    EXPECT_FALSE(fd.valid());
  }
  EXPECT_EQ(released, raw);
  EXPECT_TRUE(FdIsOpen(raw));
  ::close(raw);
}

TEST(MemoryMappingTest, AnonymousIsZeroedAndWritable) {
  Result<MemoryMapping> m = MemoryMapping::Anonymous(1 << 20);
  ASSERT_TRUE(m.has_value()) << m.error();
  EXPECT_EQ(m->size_bytes(), 1u << 20);
  EXPECT_EQ(m->data()[12345], 0);
  std::memset(m->data(), 0xab, m->size_bytes());
  EXPECT_EQ(m->bytes().back(), 0xab);
}

TEST(MemoryMappingTest, UnmapsOnDestruction) {
  uint8_t* addr = nullptr;
  {
    Result<MemoryMapping> m = MemoryMapping::Anonymous(4096);
    ASSERT_TRUE(m.has_value());
    addr = m->data();
    unsigned char vec = 0;
    EXPECT_EQ(::mincore(addr, 4096, &vec), 0);
  }
  unsigned char vec = 0;
  EXPECT_EQ(::mincore(addr, 4096, &vec), -1);  // ENOMEM: no longer mapped
  EXPECT_EQ(errno, ENOMEM);
}

TEST(MemoryMappingTest, MoveKeepsOneOwner) {
  Result<MemoryMapping> m = MemoryMapping::Anonymous(4096);
  ASSERT_TRUE(m.has_value());
  uint8_t* addr = m->data();
  MemoryMapping moved = std::move(*m);
  EXPECT_FALSE(m->valid());
  EXPECT_EQ(moved.data(), addr);
  moved.data()[0] = 7;
  MemoryMapping other;
  other = std::move(moved);
  EXPECT_EQ(other.data()[0], 7);
}

TEST(MemoryMappingTest, SharedMemfdMappingsSeeTheSameBytes) {
  UniqueFd fd(::memfd_create("kvtier-test", MFD_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::ftruncate(fd.get(), 8192), 0);
  MemoryMapping::Options opts{.size_bytes = 8192, .flags = MAP_SHARED, .fd = fd.get()};
  Result<MemoryMapping> a = MemoryMapping::Map(opts);
  Result<MemoryMapping> b = MemoryMapping::Map(opts);
  ASSERT_TRUE(a.has_value() && b.has_value());
  a->data()[100] = 42;
  EXPECT_EQ(b->data()[100], 42);
}

TEST(MemoryMappingTest, ErrorsKeepErrno) {
  Result<MemoryMapping> zero = MemoryMapping::Anonymous(0);
  ASSERT_FALSE(zero.has_value());
  EXPECT_EQ(zero.error().code(), StatusCode::kInvalidArgument);

  MemoryMapping::Options bad{.size_bytes = 4096, .flags = MAP_SHARED, .fd = 12345678};
  Result<MemoryMapping> m = MemoryMapping::Map(bad);
  ASSERT_FALSE(m.has_value());
  EXPECT_EQ(m.error().source(), ErrorSource::kErrno);
  EXPECT_EQ(m.error().raw_code(), EBADF);
}

}  // namespace
}  // namespace kvtier
