// harness.h: the host side of a shim test driver (kernels/shim/*_driver.cpp). A driver is one
// small program per kernel file: it includes qccl_shim.h, the .cu file and this header, and
// maps entry names to functions that load inputs, launch the kernel and save outputs.
//
// Command line: DRIVER ENTRY key=value... Values are numbers, or paths of input files (raw
// bytes, read with load) and of output files (written with save). tests/shim/mod.rs builds
// and runs drivers this way.
#pragma once
#include "qccl_shim.h"

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace qccl_harness {

[[noreturn]] inline void die(const std::string& msg) {
    std::fprintf(stderr, "harness: %s\n", msg.c_str());
    std::exit(2);
}

struct Args {
    std::map<std::string, std::string> kv;

    const std::string& get(const std::string& key) const {
        auto it = kv.find(key);
        if (it == kv.end()) die("missing argument " + key);
        return it->second;
    }
    uint64_t u64(const std::string& key) const { return std::stoull(get(key)); }
    double f64(const std::string& key) const { return std::stod(get(key)); }

    // The bytes of the input file named by argument `key`, as elements of T.
    template <class T>
    std::vector<T> load(const std::string& key) const {
        const std::string& path = get(key);
        FILE* f = std::fopen(path.c_str(), "rb");
        if (!f) die("cannot open " + path);
        std::vector<uint8_t> bytes;
        uint8_t buf[1 << 16];
        size_t got;
        while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.insert(bytes.end(), buf, buf + got);
        std::fclose(f);
        if (bytes.size() % sizeof(T)) die(key + ": size is not a multiple of the element size");
        std::vector<T> out(bytes.size() / sizeof(T));
        if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
        return out;
    }

    // Writes `v` to the output file named by argument `key`.
    template <class T>
    void save(const std::string& key, const std::vector<T>& v) const {
        const std::string& path = get(key);
        FILE* f = std::fopen(path.c_str(), "wb");
        if (!f) die("cannot create " + path);
        if (!v.empty() && std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size())
            die("short write to " + path);
        std::fclose(f);
    }
};

using Entry = void (*)(const Args&);

// A grid for `n` items of work: enough blocks of `block` threads, capped so that the
// grid-stride loops are exercised at large counts.
inline dim3 grid_for(uint64_t n, unsigned block, unsigned cap = 64) {
    uint64_t g = (n + block - 1) / block;
    return dim3((unsigned)(g == 0 ? 1 : g < cap ? g : cap));
}

inline int main_with(int argc, char** argv, const std::map<std::string, Entry>& entries) {
    if (argc < 2) die("usage: DRIVER ENTRY key=value...");
    auto it = entries.find(argv[1]);
    if (it == entries.end()) die(std::string("unknown entry ") + argv[1]);
    Args a;
    for (int i = 2; i < argc; i++) {
        std::string s = argv[i];
        size_t eq = s.find('=');
        if (eq == std::string::npos) die("argument without '=': " + s);
        a.kv[s.substr(0, eq)] = s.substr(eq + 1);
    }
    it->second(a);
    return 0;
}

}  // namespace qccl_harness
