import time, torch, sys
from transformers import LlamaConfig, LlamaForCausalLM
torch.set_num_threads(2)
h, L, inter, V = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
T, B = int(sys.argv[5]), int(sys.argv[6]); amp = sys.argv[7] == "bf16"
cfg = LlamaConfig(hidden_size=h, num_hidden_layers=L, intermediate_size=inter, num_attention_heads=h//64, num_key_value_heads=max(1,h//128), vocab_size=V, max_position_embeddings=1024, tie_word_embeddings=True)
m = LlamaForCausalLM(cfg); n = sum(p.numel() for p in m.parameters())
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
x = torch.randint(0, V, (B, T))
for i in range(6):
    if i == 2: t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = m(input_ids=x, labels=x).loss
    loss.backward(); opt.step(); opt.zero_grad()
dt = (time.perf_counter() - t) / 4
print(f"params {n/1e6:.2f}M  T={T} B={B} {sys.argv[7]}: {dt:.3f}s/step  {B*T/dt:.0f} tok/s")
