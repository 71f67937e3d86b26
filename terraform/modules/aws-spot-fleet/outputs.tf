output "autoscaling_group_name" {
  description = "Name of the Spot Auto Scaling group."
  value       = aws_autoscaling_group.this.name
}

output "autoscaling_group_arn" {
  description = "ARN of the Spot Auto Scaling group."
  value       = aws_autoscaling_group.this.arn
}

output "launch_template_id" {
  description = "ID of the launch template (IMDSv2 required, encrypted root volume)."
  value       = aws_launch_template.this.id
}

output "iam_role_name" {
  description = "Name of the instance role; attach more policies to it for the trainer's own needs."
  value       = aws_iam_role.this.name
}

output "iam_role_arn" {
  description = "ARN of the instance role."
  value       = aws_iam_role.this.arn
}

output "instance_profile_arn" {
  description = "ARN of the instance profile."
  value       = aws_iam_instance_profile.this.arn
}

output "bucket_name" {
  description = "Name of the checkpoint bucket (created or given)."
  value       = local.bucket_name
}

output "checkpoint_url" {
  description = "Where checkpoints go (spotguard's bucket setting; `spotguard list` it from anywhere with access)."
  value       = local.bucket_url
}

output "peer_security_group_id" {
  description = "Security group that opens the peer port between the group's own instances; null when enable_peers is false."
  value       = one(aws_security_group.peers[*].id)
}
