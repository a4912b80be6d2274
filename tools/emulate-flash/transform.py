# Rewrites kernels/cuda/flash.cu (and common.cuh) as host C++ for tools/emulate-flash.sh:
# shared memory becomes static arrays (blocks run one after another), __syncthreads a barrier
# of the block's threads, shuffles an exchange through the warp's buffer; the kernels' entry
# points are dropped (the harness calls the templates) and mma.sync is shim.h's emulation.
import re, sys
import os
src = sys.argv[1]
out = sys.argv[2]
def host(s):
    s = s.replace('#pragma once', '')
    s = s.replace('#include "common.cuh"', '#include "common_host.h"')
    s, asm = re.subn(r'__device__ __forceinline__ void mma\(.*?\n\}\n', '', s, flags=re.S)
    assert asm in (0, 2), f'expected the two mma.sync wrappers, found {asm}'
    s = s.replace('__device__ __forceinline__', 'inline')
    s = s.replace('__device__', '')
    s = s.replace('__shared__ __align__(16)', 'alignas(16) static')
    s = s.replace('__shared__', 'static')
    s = s.replace('__syncthreads()', 'sync_block()')
    s = re.sub(r'__shfl_xor_sync\(0xffffffffu, ', 'shfl_xor(', s)
    s = s.replace('#pragma unroll', '')
    return s
c = host(open(src + 'common.cuh').read())
c = c.split('// One grid-stride')[0]
open(os.path.join(out, 'common_host.h'), 'w').write('#pragma once\n#include "shim.h"\n' + c)
f = host(open(src + 'flash.cu').read())
f = f.split('#define FA_D')[0]
open(os.path.join(out, 'flash_host.h'), 'w').write('#pragma once\n' + f)
