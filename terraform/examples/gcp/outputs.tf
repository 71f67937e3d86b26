output "instance_group_manager" {
  description = "The regional managed instance group."
  value       = module.fleet.instance_group_manager
}

output "checkpoint_url" {
  description = "Where checkpoints are uploaded: `spotguard list <url>` shows them."
  value       = module.fleet.checkpoint_url
}
