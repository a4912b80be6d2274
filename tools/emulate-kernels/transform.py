# Rewrites CUDA kernel files (crates/pipewright/src/kernels/cuda/NAME.cu and every header
# NAME.cuh they share) as host C++ for tools/emulate-kernels.sh: shared memory becomes static arrays (blocks run
# one after another), __syncthreads a barrier of the block's threads, shuffles an exchange
# through the warp's buffer, entry points plain functions of the same names; mma.sync is
# shim.h's emulation, the _rn intrinsics IEEE operations.
#
#   transform.py SRC_DIR OUT_DIR NAME...   writes OUT_DIR/HEADER_host.h for each header and
#                                          OUT_DIR/NAME_host.h for each kernel file named
import os
import re
import sys


def host(s):
    s = s.replace('#pragma once', '')
    s = re.sub(r'#include "(\w+)\.cuh"', r'#include "\1_host.h"', s)
    s, asm = re.subn(r'__device__ __forceinline__ void mma\(.*?\n\}\n', '', s, flags=re.S)
    assert asm in (0, 2), f'expected the two mma.sync wrappers, found {asm}'
    s = s.replace('extern "C" __global__', '')
    s = re.sub(r'__launch_bounds__\([^)]*\)', '', s)
    s = s.replace('__device__ __forceinline__', 'inline')
    s = s.replace('__device__', '')
    s = s.replace('__shared__ __align__(16)', 'alignas(16) static')
    s = s.replace('__shared__', 'static')
    s = s.replace('__syncthreads()', 'sync_block()')
    s = re.sub(r'__shfl_xor_sync\(0xffffffffu, ', 'shfl_xor(', s)
    s = s.replace('#pragma unroll', '')
    return s


src, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
for header in sorted(f for f in os.listdir(src) if f.endswith('.cuh')):
    stem = header[:-len('.cuh')]
    text = host(open(os.path.join(src, header)).read())
    # The shim comes first: common.cuh is the header every other one includes.
    first = '#include "shim.h"\n' if stem == 'common' else ''
    open(os.path.join(out, stem + '_host.h'), 'w').write('#pragma once\n' + first + text)
for name in names:
    text = host(open(os.path.join(src, name + '.cu')).read())
    open(os.path.join(out, name + '_host.h'), 'w').write('#pragma once\n' + text)
