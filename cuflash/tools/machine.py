"""What this machine has for cuflash: CuPy, NVRTC, the CUDA runtime and driver, the GPU and its
compile target. Shared by the command line, the benchmark and the tuner; never raises."""
from __future__ import annotations

import sys
from pathlib import Path

#: How to get CuPy, which also brings NVRTC (the compiler every kernel goes through).
INSTALL_CUPY = 'pip install "cuflash[cuda13]" for CUDA 13, or "cuflash[cuda12]" for CUDA 12'


def gpu_status() -> tuple[bool, str]:
    """(True, "") when CuPy can see at least one CUDA device, else (False, why not)."""
    try:
        import cupy
    except ImportError as exc:
        return False, f"CuPy is not importable ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver or device
        return False, f"CUDA reports no usable device ({exc})"
    if count == 0:
        return False, "CUDA reports no device"
    return True, ""


def _cuda_version(value: int) -> str:
    # CUDA encodes versions as 1000 * major + 10 * minor.
    return f"{value // 1000}.{(value % 1000) // 10}"


def _package_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cuflash_version() -> str:
    import cuflash
    return getattr(cuflash, "__version__", None) or _package_version("cuflash") or "unknown"


def cuflash_dir() -> Path:
    """The folder of the imported cuflash package (the checkout or site-packages)."""
    import cuflash
    return Path(cuflash.__file__).resolve().parent


def missing_compiler(env: dict) -> str | None:
    """Why kernels cannot be compiled here (no CuPy, or CuPy without NVRTC), or None when they can."""
    if env["cupy"] is None:
        return "CuPy is not installed, and with it NVRTC, the CUDA compiler cuflash builds kernels with"
    if env["nvrtc"] is None:
        return f"CuPy {env['cupy']} is installed but cannot load NVRTC, the CUDA compiler cuflash builds kernels with"
    return None


def environment() -> dict:
    """What is known about this machine's software and GPU; never raises."""
    env: dict = {"cuflash": cuflash_version(), "python": sys.version.split()[0]}
    for name in ("numpy", "jinja2", "ml_dtypes"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    try:
        import cupy
        env["cupy"] = cupy.__version__
    except ImportError:
        env["cupy"] = None
        cupy = None
    try:
        from cupy.cuda import nvrtc
        env["nvrtc"] = "{}.{}".format(*nvrtc.getVersion())
    except Exception:
        env["nvrtc"] = None
    env["cuda_runtime"] = env["driver"] = env["gpu"] = env["compute_capability"] = None
    env["arch"] = None
    if cupy is None:
        return env
    try:
        env["cuda_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:
        pass
    try:
        driver = cupy.cuda.runtime.driverGetVersion()
        env["driver"] = _cuda_version(driver) if driver else None
    except Exception:
        pass
    available, _ = gpu_status()
    if available:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        name = props["name"]
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        env["compute_capability"] = f"{props['major']}.{props['minor']}"
        env["multiprocessors"] = props["multiProcessorCount"]
        env["memory_gib"] = round(props["totalGlobalMem"] / 2**30, 1)
        try:
            from cuflash.core.compile import device_arch
            env["arch"] = device_arch()
        except Exception:
            from cuflash.core.spec import arch_from_capability
            try:
                env["arch"] = arch_from_capability(props["major"], props["minor"])
            except ValueError:
                env["arch"] = None
    return env


def causal_modes(choice: str) -> tuple[bool, ...]:
    return {"both": (False, True), "yes": (True,), "no": (False,)}[choice]
