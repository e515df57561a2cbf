"""The expert exchange: how a MoE shard holder and its expert peers speak (sans-I/O).

Files and roles:

    wire.py     the format: header, hello / welcome / refuse, requests (rows once + per-expert
                indices, f32 or q8) and replies, every bound as a named constant; the encoders
    decode.py   its bounded decoder (every declaration checked before allocation)
    link.py     the link states of one connection (a client link fails for good; the server
                speaks hello first)
"""
