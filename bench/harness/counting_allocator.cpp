// Live and peak bytes of every torch CPU storage, counted by wrapping the CPU allocator
// ([Note: live tensor bytes from a counting allocator] in bench/harness/tensor_peaks.py). Counted in the allocator,
// so on every thread alike: autograd's, gloo's workers' (their collectives' buffers), the engine's and FSDP2's.
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>

namespace {
std::atomic<int64_t> live{0};
std::atomic<int64_t> peak{0};

struct Held {
  c10::DataPtr inner;
  int64_t nbytes;
};

void add(int64_t nbytes) {
  int64_t now = live.fetch_add(nbytes) + nbytes;
  int64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

void release(void* context) {
  auto* held = static_cast<Held*>(context);
  live.fetch_sub(held->nbytes);
  delete held;
}

struct CountingAllocator final : c10::Allocator {
  c10::Allocator* inner = nullptr;
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr data = inner->allocate(nbytes);
    add(static_cast<int64_t>(nbytes));
    void* pointer = data.get();
    auto* held = new Held{std::move(data), static_cast<int64_t>(nbytes)};
    return {pointer, held, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator counting;
}  // namespace

// Storages made before install() keep the allocator that made them: they are never counted, so their frees are not.
void install() {
  if (counting.inner == nullptr) {
    counting.inner = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&counting, /*priority=*/100);
  }
}
// Bytes a tensor holds outside the allocator (torch.frombuffer over an mmap): added when mapped, taken off when
// unmapped.
void account(int64_t nbytes) { add(nbytes); }
int64_t live_bytes() { return live.load(); }
int64_t peak_bytes() { return peak.load(); }
int64_t reset_peak() { int64_t now = live.load(); peak.store(now); return now; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("account", &account);
  m.def("live_bytes", &live_bytes);
  m.def("peak_bytes", &peak_bytes);
  m.def("reset_peak", &reset_peak);
}
