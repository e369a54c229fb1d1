// A C++ engine that keeps its own transport and gets mcguard's
// verification on top: the pattern for NIXL, UCX or an engine's own verbs.
// LoopEngine is a small in-process transport with the property that makes
// the guard necessary: it acknowledges a write before the bytes land (a
// background thread delivers them a little later, as a posted RDMA write
// lands after its completion). The guard reaches it through
// mc_transport_ops; the engine moves every byte.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mcguard.h"

namespace {

class LoopEngine {
   public:
    // lag: how long after it is posted a write lands. until_read: a write
    // lands only once the engine served a read after it was posted (so the
    // first read-back of a write always sees the bytes before it).
    explicit LoopEngine(std::chrono::microseconds lag, bool until_read = false)
        : lag_(lag), until_read_(until_read), deliverer_([this] { deliver(); }) {}
    ~LoopEngine() {
        {
            std::lock_guard<std::mutex> l(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        deliverer_.join();
    }

    // A peer's memory, as the engine's own metadata would list it.
    void add_segment(const std::string &name, uint64_t addr, uint64_t len) {
        std::lock_guard<std::mutex> l(mu_);
        segments_[name][addr] = len;
    }

    mc_transport_ops ops() {
        mc_transport_ops o{};
        o.struct_size = sizeof(o);
        o.name = "loop";
        o.write = [](void *ctx, const char *s, const uint64_t *l, const uint64_t *r, const uint64_t *n, size_t k,
                     char *msg, size_t msg_len) { return static_cast<LoopEngine *>(ctx)->move(true, s, l, r, n, k, msg, msg_len); };
        o.read = [](void *ctx, const char *s, const uint64_t *l, const uint64_t *r, const uint64_t *n, size_t k,
                    char *msg, size_t msg_len) { return static_cast<LoopEngine *>(ctx)->move(false, s, l, r, n, k, msg, msg_len); };
        o.register_memory = [](void *ctx, uint64_t addr, uint64_t len, char *, size_t) {
            auto *e = static_cast<LoopEngine *>(ctx);
            std::lock_guard<std::mutex> l(e->mu_);
            e->local_[addr] = len;
            return MC_OK;
        };
        o.unregister_memory = [](void *ctx, uint64_t addr, char *, size_t) {
            auto *e = static_cast<LoopEngine *>(ctx);
            std::lock_guard<std::mutex> l(e->mu_);
            e->local_.erase(addr);
            return MC_OK;
        };
        return o;
    }

   private:
    static bool inside(const std::map<uint64_t, uint64_t> &regions, uint64_t addr, uint64_t n) {
        for (const auto &r : regions)
            if (addr >= r.first && addr + n <= r.first + r.second) return true;
        return false;
    }

    mc_status move(bool write, const char *session, const uint64_t *local, const uint64_t *remote,
                   const uint64_t *len, size_t n, char *msg, size_t msg_len) {
        std::unique_lock<std::mutex> l(mu_);
        auto seg = segments_.find(session);
        if (seg == segments_.end()) {
            snprintf(msg, msg_len, "loop engine: no segment named %s", session);
            return MC_ERR_PEER;
        }
        for (size_t i = 0; i < n; i++) {
            if (!inside(local_, local[i], len[i]) || !inside(seg->second, remote[i], len[i])) {
                snprintf(msg, msg_len, "loop engine: descriptor %zu is not registered", i);
                return MC_ERR_NOT_REGISTERED;
            }
        }
        for (size_t i = 0; i < n; i++) {
            if (!write) {
                memcpy(reinterpret_cast<void *>(local[i]), reinterpret_cast<const void *>(remote[i]), len[i]);
                continue;
            }
            // Acknowledged now, landed later: the bytes are taken now (the
            // NIC read them), written when the deliverer gets to them.
            const auto *src = reinterpret_cast<const uint8_t *>(local[i]);
            posted_.push_back({remote[i], std::vector<uint8_t>(src, src + len[i]),
                               std::chrono::steady_clock::now() + lag_, until_read_});
        }
        if (!write)  // what was posted before this read may land now
            for (auto &p : posted_) p.held = false;
        cv_.notify_all();
        return MC_OK;
    }

    void deliver() {
        std::unique_lock<std::mutex> l(mu_);
        while (!stop_) {
            if (posted_.empty()) {
                cv_.wait(l);
                continue;
            }
            auto &w = posted_.front();
            if (w.held) {
                cv_.wait(l);
                continue;
            }
            if (std::chrono::steady_clock::now() < w.due) {
                cv_.wait_until(l, w.due);
                continue;
            }
            memcpy(reinterpret_cast<void *>(w.dst), w.bytes.data(), w.bytes.size());
            posted_.pop_front();
        }
    }

    struct Posted {
        uint64_t dst;
        std::vector<uint8_t> bytes;
        std::chrono::steady_clock::time_point due;
        bool held;  // until the engine serves a read
    };

    std::chrono::microseconds lag_;
    bool until_read_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::map<uint64_t, uint64_t> local_;
    std::map<std::string, std::map<uint64_t, uint64_t>> segments_;
    std::deque<Posted> posted_;
    std::thread deliverer_;
};

constexpr size_t kBlocks = 64, kBlock = 4096, kSize = kBlocks * kBlock;

std::string last_error(mc_guard_t g) {
    char buf[1024];
    mc_guard_last_error(g, buf, sizeof buf);
    return buf;
}

// A prefill guard over the engine, a decode guard (plain) whose memory
// is the engine segment "decode:0".
struct Pd {
    // The memory first, the engine after it: members are destroyed in
    // reverse, so the engine's deliverer stops before the memory it may
    // still be writing into is freed (a write posted just before the test
    // ended would otherwise land in freed memory).
    std::vector<uint8_t> src = std::vector<uint8_t>(kSize), dst = std::vector<uint8_t>(kSize);
    LoopEngine engine;
    mc_guard_t prefill = 0, decode = 0;
    std::vector<uint64_t> s, d, n;

    explicit Pd(const char *config, std::chrono::microseconds lag = std::chrono::microseconds(2000),
                bool until_read = false)
        : engine(lag, until_read) {
        mc_transport_ops ops = engine.ops();
        EXPECT_EQ(MC_OK, mc_guard_open_with_transport(config, &ops, &engine, &prefill)) << last_error(0);
        EXPECT_EQ(MC_OK, mc_guard_open(nullptr, &decode)) << last_error(0);
        EXPECT_EQ(MC_OK, mc_guard_register(prefill, src.data(), kSize)) << last_error(prefill);
        EXPECT_EQ(MC_OK, mc_guard_register(decode, dst.data(), kSize)) << last_error(decode);
        engine.add_segment("decode:0", reinterpret_cast<uint64_t>(dst.data()), kSize);
        for (size_t i = 0; i < kBlocks; i++) {
            s.push_back(reinterpret_cast<uint64_t>(src.data() + i * kBlock));
            d.push_back(reinterpret_cast<uint64_t>(dst.data() + i * kBlock));
            n.push_back(kBlock);
        }
    }
    ~Pd() {
        mc_guard_close(prefill);
        mc_guard_close(decode);
    }
    void fill(unsigned seed) {
        std::mt19937 r(seed);
        for (auto &b : src) b = static_cast<uint8_t>(r());
    }
    mc_status transfer(int verify, mc_transfer_opts *o = nullptr) {
        mc_transfer_opts local{};
        if (o == nullptr) o = &local;
        o->struct_size = sizeof(*o);
        o->verify = verify;
        return mc_guard_transfer(prefill, "decode:0", s.data(), d.data(), n.data(), kBlocks, o);
    }
};

TEST(EngineExample, OffReturnsBeforeTheBytesLand) {
    // A lag of a second: with 2 ms, a test thread held off the CPU that
    // long after the call (a loaded machine) saw the bytes delivered.
    Pd pd(nullptr, std::chrono::seconds(1));
    pd.fill(1);
    ASSERT_EQ(MC_OK, pd.transfer(MC_VERIFY_OFF)) << last_error(pd.prefill);
    EXPECT_NE(0, memcmp(pd.src.data(), pd.dst.data(), kSize)) << "the engine's complete is not delivered";
}

TEST(EngineExample, TailAndSampleReturnOnlyOnceTheBytesLanded) {
    // Writes land only after the guard's first read-back of them: however
    // the machine schedules this thread, the check must poll at least once.
    Pd pd(R"({"retry_sleep_s": 0.0005})", std::chrono::microseconds(0), true);
    for (int mode : {MC_VERIFY_TAIL, MC_VERIFY_SAMPLE, MC_VERIFY_FULL}) {
        pd.fill(mode + 10);
        mc_transfer_opts o{};
        ASSERT_EQ(MC_OK, pd.transfer(mode, &o)) << last_error(pd.prefill);
        EXPECT_EQ(0, memcmp(pd.src.data(), pd.dst.data(), kSize)) << "mode " << mode;
        EXPECT_GT(o.retries, 0u) << "it polled while the engine delivered";
    }
}

TEST(EngineExample, DigestModeIsCheckedByTheDecodeGuard) {
    Pd pd(R"({"verify": "digest"})", std::chrono::milliseconds(200));
    char endpoint[128];
    ASSERT_EQ(MC_OK, mc_guard_endpoint(pd.decode, endpoint, sizeof endpoint));
    ASSERT_EQ(MC_OK, mc_guard_set_peer_guard(pd.prefill, "decode:0", endpoint)) << last_error(pd.prefill);
    pd.fill(3);
    mc_transfer_opts o{};
    ASSERT_EQ(MC_OK, pd.transfer(MC_VERIFY_DEFAULT, &o)) << last_error(pd.prefill);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the decode side's own "done" message
    ASSERT_EQ(MC_OK, mc_guard_sync_transfers(pd.decode, &o.transfer_id, 1, nullptr)) << last_error(pd.decode);
    EXPECT_EQ(0, memcmp(pd.src.data(), pd.dst.data(), kSize));

    pd.fill(4);
    ASSERT_EQ(MC_OK, pd.transfer(MC_VERIFY_DEFAULT, &o));
    ASSERT_EQ(MC_ERR_VERIFY, mc_guard_sync_transfers(pd.decode, &o.transfer_id, 1, nullptr))
        << "synced before the engine delivered: the digests say so";
}

TEST(EngineExample, EngineErrorsComeBackWithItsMessage) {
    Pd pd(nullptr);
    mc_transfer_opts o{};
    o.struct_size = sizeof o;
    o.verify = MC_VERIFY_TAIL;
    EXPECT_EQ(MC_ERR_PEER, mc_guard_transfer(pd.prefill, "nobody:0", pd.s.data(), pd.d.data(), pd.n.data(), 1, &o));
    EXPECT_NE(std::string::npos, last_error(pd.prefill).find("no segment named nobody:0")) << last_error(pd.prefill);
    EXPECT_EQ(MC_ABORT_UNCONFIRMED, o.abort_state);
    // Before writing the failed transfer's blocks again: none of its
    // engine calls is still running (its one call returned with the error).
    EXPECT_NE(0u, o.transfer_id) << "a failed transfer's id is given";
    EXPECT_EQ(MC_OK, mc_guard_wait_engine_calls(pd.prefill, o.transfer_id, 1000)) << last_error(pd.prefill);
    EXPECT_EQ(MC_ERR_INVALID_ARG, mc_guard_wait_engine_calls(pd.prefill, 0, 0)) << "an id the guard never gave";
    uint64_t outside = pd.d[0] + kSize;
    EXPECT_EQ(MC_ERR_NOT_REGISTERED,
              mc_guard_transfer(pd.prefill, "decode:0", pd.s.data(), &outside, pd.n.data(), 1, &o));

    mc_transport_ops ops = pd.engine.ops();
    ops.read = nullptr;
    mc_guard_t g = 0;
    EXPECT_EQ(MC_ERR_INVALID_ARG, mc_guard_open_with_transport(nullptr, &ops, &pd.engine, &g));
    ops = pd.engine.ops();
    ops.struct_size = 8;
    EXPECT_EQ(MC_ERR_INVALID_ARG, mc_guard_open_with_transport(nullptr, &ops, &pd.engine, &g));
    EXPECT_EQ(MC_ERR_INVALID_ARG, mc_guard_set_peer_guard(pd.decode, "a:1", "b:2")) << "not a guard over an engine";
}

}  // namespace
