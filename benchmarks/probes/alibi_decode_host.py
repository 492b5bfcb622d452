"""Host time of a patched ALiBi model's decode step on the CPU (tiny BLOOM and Falcon-ALiBi, 12 layers).

A left-padded batch of 2, 100 decode steps with the growing attention mask (as ``generate`` passes it),
one thread; prints the median and best of 5 runs in ms per step. Run it with ``PYTHONPATH`` set to each
of two checkouts in turn to compare their host cost.

    PYTHONPATH=. python benchmarks/probes/alibi_decode_host.py LABEL
"""

import time, statistics, torch, transformers, torchembed, sys
torch.manual_seed(0); torch.set_num_threads(1)
res={}
for name, cfg in (("bloom", transformers.BloomConfig(hidden_size=64, n_layer=12, n_head=4, vocab_size=128)),
                  ("falcon", transformers.FalconConfig(hidden_size=64, num_hidden_layers=12, num_attention_heads=4, vocab_size=128, alibi=True, new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True))):
    m=torchembed.patch(transformers.AutoModelForCausalLM.from_config(cfg).eval())
    ids=torch.randint(3,120,(2,16)); mask=torch.ones_like(ids); mask[0,:3]=0
    times=[]
    with torch.no_grad():
        for rep in range(5):
            cache=transformers.DynamicCache(); out=m(ids, attention_mask=mask, past_key_values=cache)
            am=mask; nxt=ids[:,-1:]
            t=time.perf_counter()
            for _ in range(100):
                am=torch.cat((am, torch.ones(2,1,dtype=am.dtype)),1)
                out=m(nxt, attention_mask=am, past_key_values=out.past_key_values)
            times.append((time.perf_counter()-t)/100*1e3)
    res[name]=(statistics.median(times), min(times))
print(sys.argv[1], {k:(round(a,3),round(b,3)) for k,(a,b) in res.items()})
