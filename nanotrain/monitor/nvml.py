"""GPU utilisation, power and temperature from NVML, sampled by a background thread.

The step loop asks once a step (``sampler(step)``, a loop hook) and gets the means of the samples
taken since it last asked, so a short step and a long one are both seen as the driver saw them.
Sampling costs one NVML query of three values every ``interval_s`` on a thread that sleeps in
between; the step never waits for it. ``NvmlSampler.start`` returns None where there is nothing
true to report (no CUDA device, or no ``nvidia-ml-py``): the GPU panels are then absent, not fake.
"""
from __future__ import annotations

import threading

import torch


class NvmlSampler:
    def __init__(self, handle, nvml, interval_s: float = 0.5):
        self._nvml, self._handle, self.interval_s = nvml, handle, interval_s
        self._lock = threading.Lock()
        self._sums, self._count = [0.0, 0.0, 0.0], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanotrain-nvml", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, device: torch.device, interval_s: float = 0.5) -> NvmlSampler | None:
        """A sampler of ``device``'s GPU, or None (with a note when only the package is missing)."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        try:
            import pynvml  # nvidia-ml-py: optional (pip install nanotrain[gpu])
        except ImportError:
            print("note: no GPU utilisation, power or temperature panels: pip install nvidia-ml-py", flush=True)
            return None
        index = torch.cuda.current_device() if device.index is None else device.index
        try:
            pynvml.nvmlInit()
            try:  # by UUID: CUDA and NVML number the GPUs differently under CUDA_VISIBLE_DEVICES
                uuid = str(torch.cuda.get_device_properties(index).uuid)
                handle = pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid).encode())
            except (AttributeError, TypeError, pynvml.NVMLError):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as e:  # e.g. a container without the driver's NVML library
            print(f"note: no GPU utilisation, power or temperature panels: NVML failed ({e})", flush=True)
            return None
        return cls(handle, pynvml, interval_s)

    def _sample(self) -> tuple[float, float, float]:
        nv = self._nvml
        util = nv.nvmlDeviceGetUtilizationRates(self._handle).gpu
        power = nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # milliwatts
        temp = nv.nvmlDeviceGetTemperature(self._handle, nv.NVML_TEMPERATURE_GPU)
        return float(util), power, float(temp)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            values = self._sample()
            with self._lock:
                self._sums = [a + b for a, b in zip(self._sums, values)]
                self._count += 1

    def __call__(self, step: int) -> dict:
        """Means since the last call (one fresh sample if the thread took none meanwhile)."""
        with self._lock:
            sums, count = self._sums, self._count
            self._sums, self._count = [0.0, 0.0, 0.0], 0
        if count == 0:
            sums, count = list(self._sample()), 1
        util, power, temp = (v / count for v in sums)
        return {"gpu_util_pct": util, "gpu_power_w": power, "gpu_temp_c": temp}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()
