// emu_entry.h: the emulated CUDA driver's packed kernel entries (src/gpu/emu/kernels.rs).
//
// The emulated driver builds each kernels/*.cu into a shared object with this header and
// qccl_shim.h (QCCL_SHIM_THROW defined), and a line QCCL_EMU_ENTRY(name, fibers) per entry
// point. Each line exports two C functions the driver finds with dlsym:
//
//   const char* qccl_emu_sig_<name>(void)
//       the kernel's parameter types, one letter each: p pointer, i int32, u uint32, I int64,
//       U uint64, f float, d double, ? anything else (the driver checks its typed arguments
//       against it before launching);
//   int qccl_emu_<name>(unsigned grid, unsigned block, void** args, char* err, size_t len)
//       launches the kernel as cuLaunchKernel would (args[i] points at argument i's value),
//       in the shim's sequential mode, or its fiber mode when `fibers` is 1; returns 0, or 1
//       with the shim's message in err (a synchronising call in sequential mode, say).
#pragma once

#include <cstddef>
#include <cstdio>
#include <exception>
#include <type_traits>
#include <utility>

namespace qccl_emu {

template <class T>
constexpr char code() {
    return std::is_pointer<T>::value                                  ? 'p'
           : std::is_same<T, float>::value                            ? 'f'
           : std::is_same<T, double>::value                           ? 'd'
           : !std::is_integral<T>::value                              ? '?'
           : sizeof(T) == 4 && std::is_signed<T>::value               ? 'i'
           : sizeof(T) == 4                                           ? 'u'
           : sizeof(T) == 8 && std::is_signed<T>::value               ? 'I'
           : sizeof(T) == 8                                           ? 'U'
                                                                      : '?';
}

template <class... P>
const char* signature(void (*)(P...)) {
    static const char s[] = {code<P>()..., '\0'};
    return s;
}

template <class... P, std::size_t... I>
void call(void (*k)(P...), bool fibers, unsigned grid, unsigned block, void** args,
          std::index_sequence<I...>) {
    (void)args;  // unused for a kernel without parameters
    if (fibers)
        qccl_shim::launch_fibers(k, dim3(grid), dim3(block), *static_cast<P*>(args[I])...);
    else
        qccl_shim::launch(k, dim3(grid), dim3(block), *static_cast<P*>(args[I])...);
}

template <class... P>
int run(void (*k)(P...), bool fibers, unsigned grid, unsigned block, void** args, char* err,
        std::size_t len) {
    try {
        call(k, fibers, grid, block, args, std::index_sequence_for<P...>{});
        return 0;
    } catch (const std::exception& e) {
        std::snprintf(err, len, "%s", e.what());
    } catch (...) {
        std::snprintf(err, len, "an unknown C++ exception");
    }
    return 1;
}

}  // namespace qccl_emu

#define QCCL_EMU_ENTRY(name, fibers)                                                           \
    extern "C" const char* qccl_emu_sig_##name() { return qccl_emu::signature(name); }         \
    extern "C" int qccl_emu_##name(unsigned grid, unsigned block, void** args, char* err,      \
                                   std::size_t len) {                                          \
        return qccl_emu::run(name, fibers, grid, block, args, err, len);                       \
    }
