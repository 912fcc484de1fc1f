# Source me (bash or zsh): exports LD_PRELOAD with Debian's OpenBLAS on Linux when installed,
# unless MLX_PD_NO_OPENBLAS=1. The mlx-cpu wheel links a slow reference BLAS; preloading
# OpenBLAS makes MLX's float32 matmul much faster (see cluster/launch/platform.py). Activates nothing else.
_mlx_pd_env() {
    local lib="" cand
    [ "$(uname -s)" = Linux ] || return 0
    case "$(printf '%s' "${MLX_PD_NO_OPENBLAS:-}" | tr '[:upper:]' '[:lower:]')" in
        1|true|yes) return 0 ;;
    esac
    for cand in "/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3" \
                /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
                /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
        if [ -f "$cand" ]; then lib="$cand"; break; fi
    done
    if [ -z "$lib" ] && command -v dpkg >/dev/null 2>&1; then
        lib="$(dpkg -L libopenblas0-pthread 2>/dev/null | grep '/openblas.*/libblas\.so\.3$' | head -n 1 || true)"
    fi
    [ -n "$lib" ] && [ -f "$lib" ] || return 0
    case ":${LD_PRELOAD:-}:" in
        *":$lib:"*) return 0 ;;
    esac
    export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
}
_mlx_pd_env || true
unset -f _mlx_pd_env
