// C++17 consumer of include/mcguard.h through mcguard::mcguard, with
// GoogleTest: RAII over the C handle, transfers checked with memcmp,
// parallel sessions from several threads, and error paths.
#include <gtest/gtest.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mcguard.h"

namespace {

std::string last_error(mc_guard_t g) {
    std::string msg(mc_guard_last_error(g, nullptr, 0), '\0');
    mc_guard_last_error(g, msg.data(), msg.size() + 1);
    return msg;
}

class Guard {
public:
    explicit Guard(const char *config = nullptr) {
        mc_status st = mc_guard_open(config, &h_);
        if (st != MC_OK) throw std::runtime_error(last_error(0));
    }
    ~Guard() { if (h_) mc_guard_close(h_); }
    Guard(const Guard &) = delete;
    Guard &operator=(const Guard &) = delete;
    mc_guard_t handle() const { return h_; }
    std::string endpoint() const {
        char buf[128];
        EXPECT_EQ(mc_guard_endpoint(h_, buf, sizeof buf), MC_OK);
        return buf;
    }
    void close() { EXPECT_EQ(mc_guard_close(h_), MC_OK); closed_ = h_; h_ = 0; }
    mc_guard_t closed_handle() const { return closed_; }

private:
    mc_guard_t h_ = 0, closed_ = 0;
};

mc_transfer_opts transfer_opts(int32_t verify) {
    mc_transfer_opts o{};
    o.struct_size = sizeof o;
    o.verify = verify;
    return o;
}

uint64_t addr(const void *p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

struct Batch {
    std::vector<uint64_t> src, dst, len;
    Batch(const unsigned char *s, const unsigned char *d, size_t n, size_t block) {
        for (size_t i = 0; i < n; i++) {
            src.push_back(addr(s + i * block));
            dst.push_back(addr(d + i * block));
            len.push_back(block);
        }
    }
    mc_status send(const Guard &g, const std::string &session, mc_transfer_opts *opts = nullptr) {
        return mc_guard_transfer(g.handle(), session.c_str(), src.data(), dst.data(), len.data(), src.size(), opts);
    }
};

std::vector<unsigned char> pattern(size_t n, unsigned seed) {
    std::vector<unsigned char> v(n);
    for (size_t i = 0; i < n; i++) v[i] = static_cast<unsigned char>((i * 2654435761u + seed) >> 13);
    return v;
}

TEST(Api, TransferIsDeliveredAndVerified) {
    Guard sender("{\"verify\": \"tail\"}"), receiver;
    auto src = pattern(1 << 20, 1);
    std::vector<unsigned char> dst(1 << 20);
    ASSERT_EQ(mc_guard_register(sender.handle(), src.data(), src.size()), MC_OK);
    ASSERT_EQ(mc_guard_register(receiver.handle(), dst.data(), dst.size()), MC_OK);
    Batch b(src.data(), dst.data(), 256, 4096);
    mc_transfer_opts opts = transfer_opts(MC_VERIFY_TAIL);
    ASSERT_EQ(b.send(sender, receiver.endpoint(), &opts), MC_OK) << last_error(sender.handle());
    EXPECT_GT(opts.transfer_id, 0u);
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), dst.size()), 0);
}

TEST(Api, LateWritesAreCaughtByTail) {
    Guard sender, receiver("{\"inject\": \"reorder\", \"inject_lag_max_ms\": 20}");
    auto src = pattern(64 * 4096, 2);
    std::vector<unsigned char> dst(src.size());
    ASSERT_EQ(mc_guard_register(sender.handle(), src.data(), src.size()), MC_OK);
    ASSERT_EQ(mc_guard_register(receiver.handle(), dst.data(), dst.size()), MC_OK);
    Batch b(src.data(), dst.data(), 64, 4096);
    mc_transfer_opts opts = transfer_opts(MC_VERIFY_TAIL);
    ASSERT_EQ(b.send(sender, receiver.endpoint(), &opts), MC_OK) << last_error(sender.handle());
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), dst.size()), 0);
    EXPECT_GT(opts.retries, 0u);
}

TEST(Api, ParallelSessionsFromThreads) {
    constexpr int kSessions = 4;
    constexpr size_t kSize = 256 * 1024;
    Guard sender;
    std::vector<std::unique_ptr<Guard>> receivers;
    std::vector<std::vector<unsigned char>> srcs, dsts;
    for (int i = 0; i < kSessions; i++) {
        receivers.push_back(std::make_unique<Guard>("{\"inject\": \"lag\", \"inject_lag_max_ms\": 5}"));
        srcs.push_back(pattern(kSize, 10 + i));
        dsts.emplace_back(kSize);
        ASSERT_EQ(mc_guard_register(sender.handle(), srcs[i].data(), kSize), MC_OK);
        ASSERT_EQ(mc_guard_register(receivers[i]->handle(), dsts[i].data(), kSize), MC_OK);
    }
    std::vector<mc_status> results(kSessions, MC_ERR_INTERNAL);
    std::vector<std::thread> threads;
    for (int i = 0; i < kSessions; i++) {
        threads.emplace_back([&, i] {
            Batch b(srcs[i].data(), dsts[i].data(), 64, kSize / 64);
            std::string ep = receivers[i]->endpoint();
            for (int round = 0; round < 5; round++) results[i] = b.send(sender, ep);
        });
    }
    for (auto &t : threads) t.join();
    for (int i = 0; i < kSessions; i++) {
        EXPECT_EQ(results[i], MC_OK);
        EXPECT_EQ(std::memcmp(srcs[i].data(), dsts[i].data(), kSize), 0) << "session " << i;
    }
}

TEST(Api, ErrorPaths) {
    Guard sender("{\"connect_timeout_ms\": 200}"), receiver;
    std::vector<unsigned char> src(8192, 7), dst(8192);
    ASSERT_EQ(mc_guard_register(sender.handle(), src.data(), src.size()), MC_OK);
    ASSERT_EQ(mc_guard_register(receiver.handle(), dst.data(), dst.size()), MC_OK);
    std::string ep = receiver.endpoint();
    Batch b(src.data(), dst.data(), 2, 4096);
    auto h = sender.handle();
    EXPECT_EQ(mc_guard_transfer(h, ep.c_str(), b.src.data(), b.dst.data(), b.len.data(), 0, nullptr), MC_ERR_INVALID_ARG);
    EXPECT_NE(last_error(h).find("n is 0"), std::string::npos);
    EXPECT_EQ(mc_guard_transfer(h, ep.c_str(), nullptr, b.dst.data(), b.len.data(), 2, nullptr), MC_ERR_INVALID_ARG);
    EXPECT_EQ(mc_guard_transfer(h, ep.c_str(), b.src.data(), b.dst.data(), b.len.data(),
                                MC_GUARD_MAX_DESCRIPTORS + 1u, nullptr), MC_ERR_INVALID_ARG);
    b.dst[1] += 8192;
    EXPECT_EQ(b.send(sender, ep), MC_ERR_NOT_REGISTERED);
    EXPECT_NE(last_error(h).find("descriptor 1 remote side"), std::string::npos) << last_error(h);
    b.dst[1] -= 8192;
    mc_transfer_opts bad = transfer_opts(MC_VERIFY_TAIL);
    bad.struct_size = 1;
    EXPECT_EQ(b.send(sender, ep, &bad), MC_ERR_INVALID_ARG);
    EXPECT_EQ(std::count(dst.begin(), dst.end(), 0), static_cast<long>(dst.size())) << "refusals write nothing";
    EXPECT_EQ(b.send(sender, ep), MC_OK);
    receiver.close();
    EXPECT_EQ(mc_guard_close(receiver.closed_handle()), MC_ERR_BAD_HANDLE);
    mc_status st = b.send(sender, ep);
    EXPECT_TRUE(st == MC_ERR_PEER || st == MC_ERR_TIMEOUT) << st << " " << last_error(h);
}

TEST(Api, DigestModeIsCheckedByTheReceiver) {
    Guard sender("{\"verify\": \"digest\"}"), receiver("{\"sync_timeout_ms\": 300}");
    auto src = pattern(64 * 1024, 3);
    std::vector<unsigned char> dst(src.size());
    ASSERT_EQ(mc_guard_register(sender.handle(), src.data(), src.size()), MC_OK);
    ASSERT_EQ(mc_guard_register(receiver.handle(), dst.data(), dst.size()), MC_OK);
    Batch b(src.data(), dst.data(), 16, 4096);
    std::vector<uint64_t> digests(16);
    mc_transfer_opts opts = transfer_opts(MC_VERIFY_DEFAULT);
    opts.digests = digests.data();
    ASSERT_EQ(b.send(sender, receiver.endpoint(), &opts), MC_OK) << last_error(sender.handle());
    EXPECT_NE(digests[0], 0u);
    // The notice path: the receiver syncs by the transfer's id.
    ASSERT_EQ(mc_guard_sync_transfers(receiver.handle(), &opts.transfer_id, 1, nullptr), MC_OK)
        << last_error(receiver.handle());
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), dst.size()), 0);
    // The application-told path: ranges and digests it forwarded itself.
    mc_sync_opts so{};
    so.struct_size = sizeof so;
    so.digests = digests.data();
    ASSERT_EQ(mc_guard_sync(receiver.handle(), b.dst.data(), b.len.data(), 16, &so), MC_OK);
    dst[4096 * 7 + 1] ^= 0x40;
    EXPECT_EQ(mc_guard_sync(receiver.handle(), b.dst.data(), b.len.data(), 16, &so), MC_ERR_VERIFY);
    EXPECT_NE(last_error(receiver.handle()).find("range 7"), std::string::npos) << last_error(receiver.handle());
    uint64_t unknown = 77;
    EXPECT_EQ(mc_guard_sync_transfers(receiver.handle(), &unknown, 1, nullptr), MC_ERR_TIMEOUT);
}

}  // namespace
