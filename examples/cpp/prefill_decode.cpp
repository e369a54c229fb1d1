// Prefill and decode in two processes (one starts the other), with the C ABI
// wrapped the way a C++ engine would: a guard object that closes itself and
// throws on failure. Decode registers its KV cache and sends the region's
// endpoint and address; prefill writes the blocks in digest mode and sends
// the transfer id as its "done" message; decode syncs that id (the digests
// compared) before it reads a byte.
//
//   prefill_decode            runs both, exit 0 when decode holds prefill's bytes
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mcguard.h"

namespace {

constexpr size_t kBlocks = 64, kBlock = 64 << 10;

class Guard {
public:
    explicit Guard(const char *config) { check(mc_guard_open(config, &g_), "open", 0); }
    ~Guard() { mc_guard_close(g_); }
    Guard(const Guard &) = delete;
    Guard &operator=(const Guard &) = delete;

    std::string endpoint() const {
        char buf[128];
        check(mc_guard_endpoint(g_, buf, sizeof buf), "endpoint");
        return buf;
    }
    void register_memory(void *addr, size_t len) const { check(mc_guard_register(g_, addr, len), "register"); }
    uint64_t transfer(const std::string &peer, std::vector<uint64_t> src, std::vector<uint64_t> dst,
                      std::vector<uint64_t> len) const {
        mc_transfer_opts opts{};
        opts.struct_size = sizeof opts;
        opts.verify = MC_VERIFY_DEFAULT;
        check(mc_guard_transfer(g_, peer.c_str(), src.data(), dst.data(), len.data(), src.size(), &opts),
              "transfer");
        return opts.transfer_id;
    }
    void sync_transfer(uint64_t id) const { check(mc_guard_sync_transfers(g_, &id, 1, nullptr), "sync"); }

private:
    void check(mc_status st, const char *what, int use_handle = 1) const {
        if (st == MC_OK) return;
        char msg[512];
        mc_guard_last_error(use_handle ? g_ : 0, msg, sizeof msg);
        throw std::runtime_error(std::string(what) + ": status " + std::to_string(st) + ": " + msg);
    }
    mc_guard_t g_ = 0;
};

unsigned char pattern(size_t i) { return static_cast<unsigned char>(i * 131 + 7); }

// One line over a pipe.
void send_line(int fd, const std::string &s) {
    std::string line = s + "\n";
    if (write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) throw std::runtime_error("pipe");
}
std::string read_line(int fd) {
    std::string s;
    char c;
    while (read(fd, &c, 1) == 1 && c != '\n') s += c;
    return s;
}

int decode(int in, int out) {
    Guard g(R"({"verify": "digest"})");
    std::vector<unsigned char> kv(kBlocks * kBlock);
    g.register_memory(kv.data(), kv.size());
    send_line(out, g.endpoint() + " " + std::to_string(reinterpret_cast<uintptr_t>(kv.data())));
    uint64_t id = std::stoull(read_line(in));
    g.sync_transfer(id);  // only now may the blocks be read
    for (size_t i = 0; i < kv.size(); i++)
        if (kv[i] != pattern(i)) {
            std::fprintf(stderr, "decode: byte %zu differs after a successful sync\n", i);
            return 1;
        }
    std::fprintf(stderr, "decode : transfer %llu synced, %zu blocks hold prefill's bytes\n",
                 static_cast<unsigned long long>(id), kBlocks);
    return 0;
}

void prefill(int in, int out) {
    Guard g(R"({"verify": "digest"})");
    std::vector<unsigned char> kv(kBlocks * kBlock);
    for (size_t i = 0; i < kv.size(); i++) kv[i] = pattern(i);
    g.register_memory(kv.data(), kv.size());
    std::string hello = read_line(in);
    size_t space = hello.find(' ');
    std::string peer = hello.substr(0, space);
    uint64_t remote = std::stoull(hello.substr(space + 1));
    std::vector<uint64_t> src, dst, len;
    for (size_t i = 0; i < kBlocks; i++) {
        src.push_back(reinterpret_cast<uintptr_t>(kv.data() + i * kBlock));
        dst.push_back(remote + i * kBlock);
        len.push_back(kBlock);
    }
    uint64_t id = g.transfer(peer, src, dst, len);
    std::printf("prefill: wrote %zu x %zu KiB to %s, transfer %llu\n", kBlocks, kBlock >> 10, peer.c_str(),
                static_cast<unsigned long long>(id));
    std::fflush(stdout);
    send_line(out, std::to_string(id));
}

}  // namespace

int main(int argc, char **argv) {
    try {
        if (argc == 2 && std::strcmp(argv[1], "decode") == 0) return decode(0, 1);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "decode: %s\n", e.what());
        return 1;
    }
    // The decode process: this program again, by exec (a process that has
    // loaded libmcguard runs Go's threads, and a fork that does not exec
    // cannot use it), talking over its stdin and stdout.
    int to_decode[2], from_decode[2];
    if (pipe(to_decode) != 0 || pipe(from_decode) != 0) return 1;
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        dup2(to_decode[0], 0);
        dup2(from_decode[1], 1);
        execl("/proc/self/exe", argv[0], "decode", static_cast<char *>(nullptr));
        std::_Exit(127);
    }
    close(to_decode[0]);
    close(from_decode[1]);
    int rc = 0;
    try {
        prefill(from_decode[0], to_decode[1]);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "prefill: %s\n", e.what());
        rc = 1;
        kill(pid, SIGTERM);
    }
    close(to_decode[1]);
    int status = 0;
    waitpid(pid, &status, 0);
    return rc == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
