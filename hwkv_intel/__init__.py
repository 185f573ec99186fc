"""Intel glue that both Intel device packages (hwkv_cpu, hwkv_xpu) share and neither owns: IPEX's paged-attention
API in `hwkv_intel.ipex`. Importing the package imports nothing; IPEX itself is imported only on first use."""
