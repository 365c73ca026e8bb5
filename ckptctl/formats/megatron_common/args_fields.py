"""Every field of Megatron-LM's ``args`` ckptctl classifies, and what it does with each one.

A checkpoint's ``args`` decide how its tensors are laid out and what the network computes. A
field ckptctl misreads or ignores can turn into exit 0 with wrong weights, so a field is judged
by its class here, and by value where it has none:

* ``MAPPED``: read into the model spec, the parallel layout or the optimizer layout.
* ``PLAIN_VALUES``: changes the model's math or tensor layout and is not mapped; accepted only at
  the values that leave the model a plain one (Megatron-LM's defaults). ``RELATED_VALUES``:
  likewise, where the plain value is another field's (``validate_args`` copies it).
* ``MOE_FIELDS`` (split like the dense ones into ``MOE_MAPPED``, ``MOE_PLAIN_VALUES`` and
  ``MOE_HARMLESS``), ``MLA_FIELDS``, ``VARIANT_FIELDS``, ``MTP_FIELDS``, ``MUP_FIELDS``: read by
  Megatron only when their feature's switch is on; accepted at any value while it is off.
* ``HARMLESS``: training, data, logging, checkpointing, kernel and communication settings that do
  not change what the stored tensors mean.
* Any other field is accepted only at a default some Megatron-LM release's parser gives it
  (``release_args.json``: at its default a feature is off), and refused by name otherwise: a new
  Megatron feature in use never passes silently.

The names are Megatron-LM's ``megatron/training/arguments.py`` from core_r0.8.0 to
core_v0.19.2 (its parser's destinations and the fields ``validate_args`` and training add); every
field a release's ``validate_args`` derives is classified here (a test holds the table to that).
"""

# ruff: noqa: SIM905 (a name list reads best as words)

from __future__ import annotations

MAPPED = frozenset(
    """
    mtp_num_layers
    account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split add_bias_linear
    add_position_embedding add_qkv_bias ckptctl_hf_family ckptctl_true_vocab_size data_parallel_size
    ddp_bucket_size decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers
    expert_model_parallel_size ffn_hidden_size group_query_attention hidden_size kv_channels
    layernorm_epsilon make_vocab_size_divisible_by max_position_embeddings norm_epsilon
    normalization num_attention_heads num_experts num_layers num_layers_in_first_pipeline_stage
    num_layers_in_last_pipeline_stage num_layers_per_virtual_pipeline_stage num_query_groups
    num_virtual_stages_per_pipeline_rank overlap_grad_reduce padded_vocab_size
    pipeline_model_parallel_layout pipeline_model_parallel_size position_embedding_type
    qk_layernorm rotary_base rotary_percent squared_relu swiglu tensor_model_parallel_size
    transformer_impl untie_embeddings_and_output_weights use_distributed_optimizer
    use_rotary_position_embeddings virtual_pipeline_model_parallel_size vocab_size
    window_attn_skip_freq window_size world_size use_rope_scaling rope_scaling_factor
    yarn_beta_fast yarn_beta_slow yarn_correction_range_round_to_int
    yarn_original_max_position_embeddings activation_func_clamp_value glu_linear_offset
    quick_geglu softmax_type apply_layernorm_1p layernorm_zero_centered_gamma
    ckptctl_activation ckptctl_post_sublayer_norms ckptctl_scaled_embedding ckptctl_softmax_scale
    ckptctl_local_rotary_base ckptctl_rope_linear_factor
    attention_output_gate experimental_attention_variant linear_attention_freq
    linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads linear_num_value_heads
    linear_value_head_dim
    """.split()
)

PLAIN_VALUES: dict[str, tuple[object, ...]] = {
    "apply_residual_connection_post_layernorm": (False,),
    "decoder_num_layers": (None,),
    "encoder_pipeline_model_parallel_size": (None, 0),
    "encoder_tensor_model_parallel_size": (None, 0),
    "fused_residual_rmsnorm": (False,),
    "gtp_weight_remat_size": (1,),
    "heterogeneous_layers_config_encoded_json": (None, ""),
    "heterogeneous_layers_config_path": (None, ""),
    "hybrid_attention_ratio": (0.0,),
    "hybrid_layer_pattern": (None,),
    "hybrid_mlp_ratio": (0.0,),
    "hybrid_override_pattern": (None,),
    "is_hybrid_model": (False,),
    "mrope_section": (None,),
    "multi_latent_attention": (False,),
    "no_rope_freq": (None,),
    "num_distributed_optimizer_instances": (1,),
    "openai_gelu": (False,),  # megatron-core's models (0.12 on) ignore it: refused, not guessed
    "pad_vocab_size": (True,),
    "pipeline_model_parallel_split_rank": (None,),
    "qk_l2_norm": (False,),
    "retro_add_retriever": (False,),
    "rope_type": (None, "rope"),
    "rotary_interleaved": (False,),
    "rotary_seq_len_interpolation_factor": (None,),
    "spec": (None,),
    "standalone_embedding_stage": (False,),
    "use_custom_fsdp": (False,),
    "use_fused_weighted_squared_relu": (False,),
    "use_grouped_gemm_for_dense_mlp": (False,),
    "use_layer_wise_distributed_optimizer": (False,),
    "use_legacy_models": (False,),
    "use_megatron_fsdp": (False,),
    "use_mup": (False,),
    "use_precision_aware_optimizer": (False,),
    "use_torch_fsdp2": (False,),
    "use_transformer_engine_op_fuser": (False,),
    "yaml_cfg": (None,),
}

# Fields validate_args copies from another: plain while unset or equal to it.
RELATED_VALUES: dict[str, tuple[str, ...]] = {
    "encoder_num_layers": ("num_layers",),
    # Megatron-LM 0.19 sets each to TP (expert TP) x gtp_weight_remat_size, which is plain at 1
    "tensor_parallel_num_weight_shards": ("tensor_model_parallel_size",),
    "expert_tensor_parallel_num_weight_shards": (
        "expert_tensor_parallel_size",
        "tensor_model_parallel_size",
    ),
}

MOE_FIELDS = frozenset(
    """
    expert_gtp_weight_remat_size expert_tensor_parallel_num_weight_shards
    expert_tensor_parallel_size moe_apply_probs_on_input moe_aux_loss_coeff moe_deepep_num_sms
    moe_enable_deepep moe_enable_routing_replay moe_expert_capacity_factor
    moe_expert_rank_capacity_factor moe_extended_tp moe_ffn_hidden_size
    moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms moe_grouped_gemm
    moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms
    moe_hybridep_num_sms_preprocessing moe_hybridep_pad_uneven_dispatch_inputs
    moe_input_jitter_eps moe_latent_size moe_layer_freq moe_layer_recompute
    moe_mlp_glu_interleave_size moe_ncclep_static_shape moe_ncclep_zero_copy
    moe_pad_expert_input_to_capacity moe_pad_experts_for_cuda_graph_inference moe_paged_stash
    moe_paged_stash_buffer_size_factor_cpu moe_paged_stash_buffer_size_factor_cuda
    moe_paged_stash_page_size moe_per_layer_logging moe_permute_fusion
    moe_permute_fusion_into_hybridep moe_router_bias_update_rate moe_router_dtype
    moe_router_enable_expert_bias moe_router_force_biased moe_router_force_load_balancing
    moe_router_fusion moe_router_group_topk moe_router_load_balancing_type moe_router_num_groups
    moe_router_padding_for_fp8 moe_router_padding_for_quantization moe_router_pre_softmax
    moe_router_quantile_balancing_ema moe_router_score_function moe_router_topk
    moe_router_topk_scaling_factor moe_routing_trace_capture_hidden_states
    moe_routing_trace_capture_logits moe_routing_trace_dump_weights
    moe_routing_trace_max_training_iters moe_routing_trace_path moe_shared_expert_gate
    moe_shared_expert_glu_interleave_size moe_shared_expert_intermediate_size
    moe_shared_expert_overlap moe_single_grouped_bias moe_single_grouped_weight
    moe_token_dispatcher_type moe_token_drop_policy moe_upcycling_granularity
    moe_use_legacy_grouped_gemm moe_use_upcycling moe_z_loss_coeff
    use_grouped_gemm_for_shared_expert
    """.split()
)

# With num_experts set, MOE_FIELDS split three ways like the dense ones.
MOE_MAPPED = frozenset(
    """
    expert_tensor_parallel_size moe_ffn_hidden_size moe_grouped_gemm
    moe_router_enable_expert_bias moe_router_group_topk moe_router_num_groups
    moe_router_pre_softmax moe_router_score_function moe_router_topk
    moe_router_topk_scaling_factor moe_shared_expert_gate moe_shared_expert_intermediate_size
    moe_layer_freq
    moe_use_legacy_grouped_gemm
    """.split()
)

MOE_PLAIN_VALUES: dict[str, tuple[object, ...]] = {
    "expert_gtp_weight_remat_size": (1,),
    "moe_apply_probs_on_input": (False,),
    "moe_extended_tp": (False,),
    "moe_latent_size": (None,),
    "moe_mlp_glu_interleave_size": (None,),
    "moe_router_force_biased": (None,),
    "moe_router_force_load_balancing": (False,),
    "moe_shared_expert_glu_interleave_size": (None,),
    "moe_single_grouped_bias": (False,),
    "moe_single_grouped_weight": (False,),
    "use_grouped_gemm_for_shared_expert": (False,),
}

# Training-time routing losses, token dropping and dispatch kernels: the weights mean the same
# (token dropping by capacity happens only while training with a capacity factor).
MOE_HARMLESS = frozenset(
    """
    moe_aux_loss_coeff moe_deepep_num_sms moe_enable_deepep moe_enable_routing_replay
    moe_expert_capacity_factor moe_expert_rank_capacity_factor moe_flex_dispatcher_backend
    moe_flex_dispatcher_num_sms moe_hybridep_num_blocks_permute
    moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms moe_hybridep_num_sms_preprocessing
    moe_hybridep_pad_uneven_dispatch_inputs moe_input_jitter_eps moe_layer_recompute
    moe_ncclep_static_shape moe_ncclep_zero_copy moe_pad_expert_input_to_capacity
    moe_pad_experts_for_cuda_graph_inference moe_paged_stash
    moe_paged_stash_buffer_size_factor_cpu moe_paged_stash_buffer_size_factor_cuda
    moe_paged_stash_page_size moe_per_layer_logging moe_permute_fusion
    moe_permute_fusion_into_hybridep moe_router_bias_update_rate moe_router_dtype
    moe_router_fusion moe_router_load_balancing_type moe_router_padding_for_fp8
    moe_router_padding_for_quantization moe_router_quantile_balancing_ema
    moe_routing_trace_capture_hidden_states moe_routing_trace_capture_logits
    moe_routing_trace_dump_weights moe_routing_trace_max_training_iters moe_routing_trace_path
    moe_shared_expert_overlap moe_token_dispatcher_type moe_token_drop_policy
    moe_upcycling_granularity moe_use_upcycling moe_z_loss_coeff
    """.split()
)

MLA_FIELDS = frozenset(
    """
    cache_mla_latents kv_lora_rank mla_down_proj_fusion mscale mscale_all_dim q_lora_rank
    qk_head_dim qk_pos_emb_head_dim rotary_scaling_factor v_head_dim
    """.split()
)

HARMLESS = frozenset(
    """
    _is_global_batch_size_explicitly_specified accumulate_allreduce_grads_in_fp32
    activation_offload_fraction adam_beta1 adam_beta2 adam_eps adlr_autoresume
    adlr_autoresume_interval align_grad_reduce align_param_gather allow_ambiguous_pad_tokens
    app_tag_run_name app_tag_run_version apply_query_key_layer_scaling apply_rope_fusion
    apply_wd_to_qk_layernorm async_ckpt_cpu_priority async_ckpt_io_priority
    async_ckpt_use_cpu_shm async_save async_strategy async_tensor_model_parallel_allreduce
    attention_backend attention_dropout attention_softmax_in_fp32 auto_detect_ckpt_format
    barrier_with_L1_time batch_invariant_mode batch_size bert_binary_head bert_embedder_type
    bert_load bf16 bias_dropout_fusion bias_gelu_fusion bias_swiglu_fusion
    biencoder_projection_dim biencoder_shared_query_context_model block_data_path
    calc_ft_timeouts calculate_per_token_loss chat_template check_for_large_grads
    check_for_nan_in_loss_and_grad check_for_spiky_loss
    check_weight_hash_across_dp_replicas_interval checkpoint_activations
    ckpt_assume_constant_structure ckpt_convert_format ckpt_convert_save
    ckpt_convert_update_legacy_dist_opt_format ckpt_format ckpt_fully_parallel_load
    ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_load_process_group
    ckpt_fully_parallel_save ckpt_fully_parallel_save_deprecated
    ckpt_fully_parallel_save_process_group ckpt_load_validate_sharding_integrity ckpt_step
    classes_fraction clip_grad clone_scatter_output_in_embedding config_logger_dir
    consumed_train_bins consumed_train_samples consumed_valid_samples context_parallel_size
    cp_comm_type cpu_offloading cpu_offloading_num_layers
    cpu_offloading_retain_pinned_cpu_buffers create_all_gather_group
    create_attention_mask_in_dataloader cross_entropy_fusion_impl cross_entropy_loss_fusion
    cuda_graph_impl cuda_graph_modules cuda_graph_scope cuda_graph_scope_deprecated
    cuda_graph_warmup_steps curr_iteration data_args_path data_cache_path
    data_parallel_random_init data_parallel_sharding_strategy data_path data_per_class_fraction
    data_sharding dataloader_defer_npy_index_mmap dataloader_fast_cache_load
    dataloader_inter_document_masking dataloader_type ddp_average_in_collective ddp_num_buckets
    ddp_pad_buckets_for_high_nccl_busbw ddp_param_name_patterns_for_fp32_local_accumulation
    ddp_reduce_scatter_with_fp32_accumulation decode_only_cuda_graphs decoder_seq_length
    decoupled_lr decoupled_min_lr decrease_batch_size_if_needed defer_embedding_wgrad_compute
    delay_grad_reduce delay_offload_until_cuda_graph delay_param_gather delay_wgrad_compute
    delta_offload_bytes_across_pp_ranks deprecated_use_mcore_models deterministic_mode
    dino_bottleneck_size dino_freeze_last_layer dino_head_hidden_size dino_local_crops_number
    dino_local_img_size dino_norm_last_layer dino_teacher_temp dino_warmup_teacher_temp
    dino_warmup_teacher_temp_epochs disable_bf16_reduced_precision_matmul
    disable_chunked_prefill disable_jit_fuser disable_mamba_mem_eff_path disable_msc_deprecated
    disable_straggler_on_startup disable_symmetric_registration dist_ckpt_format
    dist_ckpt_format_deprecated dist_ckpt_optim_fully_reshardable dist_ckpt_save_pre_mcore_014
    dist_ckpt_strictness dist_ckpt_workers distrib_optim_fully_reshardable_mem_efficient
    distribute_saved_activations distributed_backend distributed_timeout_minutes
    distributed_timeout_seconds_after_init do_test do_train do_valid
    dump_param_to_param_group_map embedding_init_method_std embedding_path
    empty_unused_memory_level enable_chunked_prefill enable_cuda_graph enable_experimental
    enable_ft_package enable_full_sharding_in_hsdp enable_gloo_process_groups enable_msc
    enable_one_logger encoder_seq_length end_weight_decay eod_mask_loss
    ep_overlap_early_attn_memory_release error_injection_rate error_injection_type
    eval_global_batch_size eval_interval eval_iters eval_micro_batch_size evidence_data_path
    exit_duration_in_mins exit_interval exit_on_missing_checkpoint exit_signal
    exit_signal_handler exit_signal_handler_for_dataloader exit_signal_handler_for_training
    exp_avg_dtype exp_avg_sq_dtype external_cuda_graph fake_process_group
    fault_injector_delay_start_iteration fault_injector_fault_delay
    fault_injector_fault_probabilities fault_injector_fault_types fault_injector_mtti_seconds
    fault_injector_num_ranks fault_injector_offset_seconds fault_injector_ranks
    fault_injector_seed fim_data fim_eod_token fim_fragment_rate fim_middle_token fim_no_prefix
    fim_pad_token fim_prefix_token fim_rate fim_split_sample fim_spm_rate fim_suffix_token
    fine_grained_activation_offloading fine_grained_offloading_max_inflight_offloads finetune
    first_last_layers_bf16 flash_attention_version flash_decode flight_recorder_dump_on_timeout
    flight_recorder_dump_path flight_recorder_extra_dump_on_exec
    flight_recorder_include_only_active flight_recorder_include_stack_trace
    flight_recorder_trace_buffer_size fp16 fp16_lm_cross_entropy fp32_residual_connection fp4
    fp4_param fp4_param_gather fp4_quantizer_factory fp4_recipe fp8 fp8_amax_compute_algo
    fp8_amax_history_len fp8_interval fp8_margin fp8_output_proj fp8_param_gather
    fp8_quantizer_factory fp8_recipe fp8_wgrad freeze_all_layers
    fsdp_db_use_persist_buf_on_alloc_fail fsdp_double_buffer fsdp_manual_registration
    ft_num_warmup_iters full_validation global_batch_size gpu_sniff_test_interval
    grad_reduce_in_bf16 gradient_accumulation_fusion gradient_reduce_div_fusion
    grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_default_temperature grpo_default_top_p
    grpo_entropy_term_weight grpo_filter_groups_with_same_reward grpo_group_size grpo_iterations
    grpo_kl_beta grpo_prompts_per_step grpo_samples_per_iteration head_lr_mult hidden_dropout
    hierarchical_context_parallel_sizes high_priority_a2a_comm_stream
    high_priority_stream_groups hybrid_context_parallel hysteresis ict_head_size ict_load img_h
    img_w indexer_batch_size indexer_log_interval inference_batch_times_seqlen_threshold
    inference_coordinator_port inference_cuda_graph_all_prefills inference_cuda_graph_max_tokens
    inference_cuda_graph_scope inference_disable_ep_consensus
    inference_disable_triton_nvls_kernels inference_dynamic_batching
    inference_dynamic_batching_async_sched_mode inference_dynamic_batching_block_size
    inference_dynamic_batching_buffer_guaranteed_fraction
    inference_dynamic_batching_buffer_overflow_factor inference_dynamic_batching_buffer_size_gb
    inference_dynamic_batching_chunk_size inference_dynamic_batching_cuda_graph_max_tokens
    inference_dynamic_batching_cuda_graph_mixed_prefill_count
    inference_dynamic_batching_cuda_graph_sizing_distribution
    inference_dynamic_batching_enable_prefix_caching inference_dynamic_batching_logprobs_mode
    inference_dynamic_batching_mamba_memory_ratio inference_dynamic_batching_max_requests
    inference_dynamic_batching_max_requests_override inference_dynamic_batching_max_tokens
    inference_dynamic_batching_max_tokens_override inference_dynamic_batching_num_cuda_graphs
    inference_dynamic_batching_paused_buffer_size_gb
    inference_dynamic_batching_prefix_caching_coordinator_policy
    inference_dynamic_batching_prefix_caching_eviction_policy
    inference_dynamic_batching_prefix_caching_mamba_gb
    inference_dynamic_batching_prefix_caching_routing_alpha
    inference_dynamic_batching_sampling_backend
    inference_dynamic_batching_track_generated_token_events
    inference_dynamic_batching_track_paused_request_events
    inference_dynamic_batching_unified_memory_level inference_fuse_tp_communication
    inference_grouped_gemm_backend inference_logging_step_interval inference_max_batch_size
    inference_max_requests inference_max_seq_length inference_moe_disable_fused_quant_kernels
    inference_moe_token_dispatcher_type inference_rng_tracker inference_shards
    inference_text_gen_server_logging inference_use_synchronous_zmq_collectives
    inference_wandb_logging init_method_std init_method_xavier_uniform
    init_model_with_meta_device initial_loss_scale inprocess_active_world_size
    inprocess_barrier_timeout inprocess_completion_timeout inprocess_empty_cuda_cache
    inprocess_granularity inprocess_hard_timeout inprocess_heartbeat_interval
    inprocess_heartbeat_timeout inprocess_last_call_wait inprocess_max_iterations
    inprocess_monitor_process_interval inprocess_monitor_thread_interval
    inprocess_progress_watchdog_interval inprocess_restart inprocess_soft_timeout
    inprocess_termination_grace_time iter_per_epoch iteration iterations_to_skip
    keep_fp8_transpose_cache keep_fp8_transpose_cache_when_using_custom_fsdp
    kitchen_attention_backend kitchen_config_file kitchen_recipe_number langrl_env_config
    langrl_external_server langrl_inference_server_conversation_template
    langrl_inference_server_type lazy_mpu_init legacy_tokenizer lion_beta1 lion_beta2 load
    load_main_params_from_ckpt load_model_opt_format local_rank log_batch_size_to_tensorboard
    log_device_memory_used log_energy log_interval log_learning_rate_to_tensorboard
    log_loss_scale_to_tensorboard log_max_attention_logit log_memory_interval
    log_memory_to_tensorboard log_num_zeros_in_grad log_params_norm log_progress log_straggler
    log_throughput log_timers_to_tensorboard log_validation_ppl_to_tensorboard
    log_world_size_to_tensorboard logging_level logits_load_decode_threads logits_load_dir
    logits_load_ignore_errors logits_load_kd_loss_alpha logits_load_msc_prefetch_depth
    logits_load_prefetch_factor logits_save_dir logits_save_dtype logits_save_top_k
    logits_save_top_p logits_save_top_p_min_k loss_scale loss_scale_window lr lr_decay_iters
    lr_decay_samples lr_decay_style lr_warmup_fraction lr_warmup_init lr_warmup_iters
    lr_warmup_samples lr_wsd_decay_iters lr_wsd_decay_samples lr_wsd_decay_style
    main_grads_dtype main_params_dtype mamba_head_dim mamba_inference_conv_states_dtype
    mamba_inference_ssm_states_dtype mamba_num_groups mamba_num_heads mamba_state_dim
    mamba_training_ssm_states_dtype manual_gc manual_gc_eval manual_gc_interval mask_factor
    mask_prob mask_type masked_softmax_fusion max_seqlen_per_dp_cp_rank max_tokens_to_oom
    megatron_fsdp_enable_fine_grained_param_gather megatron_fsdp_grad_comm_dtype
    megatron_fsdp_main_grads_dtype megatron_fsdp_main_params_dtype
    megatron_fsdp_max_pool_double_buffer memory_snapshot_path merge_file metadata_path
    micro_batch_size microbatch_group_size_per_vp_stage mid_level_dataset_surplus min_loss_scale
    min_lr min_offloaded_tensor_size mlp_chunks_for_prefill mlp_chunks_for_training
    mmap_bin_files mock_data model_parallel_size model_type modelopt_enabled
    multiple_validation_sets muon_coefficient_type muon_extra_scale_factor muon_fp32_matmul_prec
    muon_momentum muon_nesterov muon_num_ns_steps muon_scalar_optimizer muon_scale_mode
    muon_split_qkv muon_tp_mode muon_use_nesterov nccl_all_reduce_for_prefill
    nccl_communicator_config_path nccl_ub no_load_optim no_load_rng no_persist_layer_norm
    no_save_optim no_save_rng no_weight_decay_cond_type non_persistent_ckpt_type
    non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo non_persistent_local_ckpt_dir
    non_persistent_save_interval null_tokenizer_eod_id null_tokenizer_pad_id num_channels
    num_classes num_dataset_builder_threads num_floating_point_operations_so_far
    num_layers_at_end_in_bf16 num_layers_at_start_in_bf16 num_speculative_tokens num_workers
    nvtx_ranges object_storage_cache_path offload_modules offset_sampling_seed_by_dp_rank
    one_logger_async one_logger_project one_logger_run_name onnx_safe optimizer
    optimizer_cpu_offload optimizer_cuda_graph optimizer_offload_fraction
    outer_dp_sharding_strategy output_bert_embeddings overlap_cpu_optimizer_d2h_h2d
    overlap_dispatch_backward_with_experts_wgrad overlap_moe_expert_parallel_comm
    overlap_p2p_comm overlap_p2p_comm_warmup_flush overlap_param_gather
    overlap_param_gather_with_optimizer_step override_ckpt_iteration
    override_opt_param_scheduler params_dtype patch_dim per_dataset_sequences_path
    per_split_data_args_path perform_initialization perform_rl_step phase_transition_iterations
    pin_cpu_grads pin_cpu_params pipeline_model_parallel_comm_backend pretrained_checkpoint
    profile profile_ranks profile_step_end profile_step_start pytorch_profiler_collect_callstack
    pytorch_profiler_collect_chakra pytorch_profiler_collect_shapes qk_clip qk_clip_alpha
    qk_clip_threshold query_in_block_prob rampup_batch_size rank recompute_activations
    recompute_granularity recompute_method recompute_modules recompute_num_layers
    record_memory_history record_shapes refit_method relative_attention_max_distance
    relative_attention_num_buckets renormalize_blend_weights replication replication_factor
    replication_jump rerun_mode reset_attention_mask reset_position_ids
    result_rejected_tracker_filename retriever_report_topk_accuracies retriever_score_scaling
    retriever_seq_length retro_attention_gate retro_cyclic_train_iters
    retro_encoder_attention_dropout retro_encoder_hidden_dropout retro_encoder_layers
    retro_num_neighbors retro_num_retrieved_chunks retro_project_dir retro_verify_neighbor_count
    reuse_grad_buf_for_mxfp8_param_ag rl_calculate_intra_group_similarity
    rl_consumption_granularity rl_default_temperature rl_default_top_k rl_default_top_p
    rl_generation_batch_size rl_generation_lag rl_importance_sampling_truncation_coef
    rl_inference_expert_model_parallel_size rl_inference_expert_tensor_model_parallel_size
    rl_inference_logprobs_is_correction rl_inference_model_unified_memory_level
    rl_inference_parsers rl_inference_pipeline_model_parallel_size
    rl_inference_tensor_model_parallel_size rl_kv_cache_management_mode
    rl_num_parallel_generation_batches rl_num_parallel_generations
    rl_offload_inference_model_weights_when_idle rl_offload_kv_cache_during_training
    rl_offload_optimizer_during_inference rl_parallel_generation_tasks rl_partial_rollouts
    rl_persist_cuda_graphs rl_profile rl_profile_dir rl_prompts_per_eval
    rl_remove_kv_cache_during_training rl_reset_cuda_graphs rl_sequence_packing_algo
    rl_sequence_packing_bin_size rl_sequence_packing_max_sequences_per_bin rl_skip_bos_token
    rl_submission_granularity rl_training_cuda_graphs rl_use_sequence_packing
    rl_verify_model_weights_swap run_workload_inspector_server s3_cache_path
    sample_rate save save_activations_interval save_dgrads_interval save_interval
    save_params_interval save_retain_interval save_tokens_per_expert_interval
    save_wgrads_interval scatter_gather_tensors_in_pipeline seed seq_length sequence_parallel
    sft sft_tokenizer_prompt_format sgd_momentum sharp_enabled_group short_seq_prob skip_train
    skipped_train_samples special_tokens split start_eval_at_iter start_weight_decay
    step_batch_size_schedule straggler_ctrlr_port straggler_minmax_count stream_ckpt_dequant
    strict_fsdp_dtensor_load suggested_communication_unit_size swin_backbone_type
    symmetric_ar_type te_precision_config_file te_rng_tracker tensorboard_dir
    tensorboard_log_interval tensorboard_queue_size test_data_path test_mode
    tiktoken_num_special_tokens tiktoken_pattern tiktoken_special_tokens timing_log_level
    timing_log_option titles_data_path to_test tokenizer_hf_include_special_tokens
    tokenizer_hf_no_include_special_tokens tokenizer_hf_no_use_fast tokenizer_hf_use_fast
    tokenizer_metadata tokenizer_model tokenizer_sentencepiece_ignore_extra_whitespaces
    tokenizer_sentencepiece_legacy tokenizer_special_tokens tokenizer_type
    torch_fsdp2_reshard_after_forward tp_comm_bootstrap_backend tp_comm_bulk_dgrad
    tp_comm_bulk_wgrad tp_comm_overlap tp_comm_overlap_ag tp_comm_overlap_cfg tp_comm_overlap_rs
    tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs train_data_path train_iters
    train_samples train_sync_interval transformer_pipeline_model_parallel_size trust_remote_code
    use_checkpoint_args use_checkpoint_opt_param_scheduler use_cpu_initialization use_dist_ckpt
    use_dist_ckpt_deprecated use_flash_attn use_gloo_process_groups use_kitchen_attention
    use_layer_wise_param_layout use_legacy_static_engine use_mamba_mem_eff_path
    use_mp_args_from_checkpoint_args use_one_sent_docs use_persistent_ckpt_worker
    use_pytorch_profiler use_ring_exchange_p2p use_sharp use_te_activation_func
    use_tokenizer_model_from_checkpoint_args use_torch_optimizer_for_cpu_offload
    use_tp_pp_dp_mapping valid_data_path validation_set_names variable_seq_lengths
    verify_integrity vision_backbone_type vision_pretraining vision_pretraining_type
    vocab_extra_ids vocab_file wandb_entity wandb_exp_name wandb_project wandb_save_dir warmup
    weight_decay weight_decay_incr_style wgrad_deferral_limit
    """.split()
)

# Read by Megatron only with an experimental attention variant (DeepSeek sparse attention's
# indexer, linear attention), with multi-token prediction, or with muP; those are refused by
# their switch (a PLAIN_VALUES field), so these are accepted at any value while it is off.
VARIANT_FIELDS = frozenset(
    """
    dsa_indexer_head_dim dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32
    dsa_indexer_loss_coeff dsa_indexer_n_heads dsa_indexer_rope_interleaved
    dsa_indexer_rotate_activation dsa_indexer_scoring_relu dsa_indexer_skip_topk_offset
    dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_use_sparse_loss dsa_kernel_backend
    """.split()
)

MTP_FIELDS = frozenset(
    """
    mtp_detach_heads mtp_hybrid_override_pattern mtp_loss_scaling_factor mtp_standalone
    mtp_use_repeated_layer
    """.split()
)

MTP_HARMLESS = frozenset({"mtp_detach_heads", "mtp_loss_scaling_factor"})
"""With multi-token prediction on: how its loss is weighted and whether its gradient reaches
the decoder; training only, the weights keep their layout."""
MTP_PLAIN_VALUES: dict[str, tuple[object, ...]] = {
    "mtp_hybrid_override_pattern": (None,),
    "mtp_standalone": (False,),
    "mtp_use_repeated_layer": (False,),
}
"""With multi-token prediction on, refused away from these: a hybrid (Mamba) MTP block, MTP on
a pipeline stage of its own (a custom pipeline layout), one layer shared by every depth."""

MUP_FIELDS = frozenset(
    """
    mup_attn_scale_power mup_base_head_dim mup_base_hidden_size mup_embedding_mult
    mup_output_mult mup_width_mult
    """.split()
)
