// ThreadSanitizer annotations for orderings TSan cannot see: those made inside libraries that
// are not TSan-built (Debian's libgrpc orders a reactor's operation before the reaction it
// causes on another thread) or by another agent's copy into our memory. The thread that hands
// something over calls TsanRelease(p) after its last write; the thread that takes it calls
// TsanAcquire(p) before its first read, with the same address. Nothing without TSan.
#pragma once

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace tandem {

inline void TsanRelease([[maybe_unused]] const void* object) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(const_cast<void*>(object));
#endif
}

inline void TsanAcquire([[maybe_unused]] const void* object) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(const_cast<void*>(object));
#endif
}

}  // namespace tandem
